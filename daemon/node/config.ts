/**
 * The daemon's configuration: one schema with defaults, validated at boot and frozen. Errors name
 * the bad key (as the CLI flag the user typed), so a typo never becomes a silent default.
 */
import { isAbsolute, resolve } from 'node:path'
import { ShoalError } from '../errors.ts'
import { DEFAULT_INGRESS_LIMITS } from '../ingress/index.ts'
import type { IngressLimits } from '../ingress/index.ts'
import { DEFAULT_TIMINGS } from '../mesh/index.ts'
import type { MeshTimings } from '../mesh/index.ts'
import { DEFAULT_CHAIN_POLICY, DEFAULT_POLICY, DEFAULT_PREFIX_ROUTE_POLICY } from '../routing/index.ts'
import type { ChainPolicy, PrefixRoutePolicy, RoutingPolicy } from '../routing/index.ts'
import type { WarmUpPlan } from './warm-up.ts'

/** One `--model` of the node (not shards' `ModelSpec`, the normalised checkpoint config). */
export interface ModelEntry {
  /** A Hugging Face checkpoint or a shard directory; 'demo' means the built-in demo model. */
  dir: string
  /** One pipeline stage of a shard directory: inclusive layer range. */
  layers?: [number, number]
}

/**
 * Three separate latency budgets, never spent on each other's behalf: the batcher's own (how long
 * a step may wait for company, and the queue wait past which new work is refused with 429), the
 * network's (silence from a peer before a forwarded request is given up), and the stream's (the
 * whole request's deadline from the client's point of view).
 */
export interface Budgets {
  batchQueueDelayMs: number
  batchBudgetMs: number
  networkIdleMs: number
  requestTimeoutMs: number
}

export const DEFAULT_BUDGETS: Readonly<Budgets> = Object.freeze({
  batchQueueDelayMs: 2,
  batchBudgetMs: 1_000,
  networkIdleMs: 30_000,
  requestTimeoutMs: 10 * 60_000,
})

export interface DaemonConfig {
  /** Identity directory from `shoal ca issue`; absent means a single machine without a mesh. */
  identityDir?: string
  models: ModelEntry[]
  api?: { host: string, port: number }
  /** 'auto' | 'cpu' (onnxruntime) | an OpenVINO device: CPU, GPU, NPU, AUTO; or a comma-separated list, one per stage of a local chain. */
  device: string
  dataDir: string
  cacheRoot: string
  /** libp2p listen multiaddrs; empty means the mesh's default (QUIC and TCP on all interfaces, ephemeral ports). */
  listen: string[]
  /**
   * Multiaddrs peers are told to dial instead of the listen addresses (a NAT's or a relay's public
   * address); absent or empty: the listen addresses.
   */
  announce?: string[]
  bootstrap: string[]
  mdns: boolean
  revocationsFile?: string
  /** The ingress accepts only client keys issued by the CA (the identity's, or `caFile`'s). */
  requireKeys?: boolean
  /** The CA certificate (ca.cert.json) for a node without an identity (`shoal serve --ca`). */
  caFile?: string
  /** How often the receipt-log head is signed for peers when it changed (default 10 s). */
  witnessIntervalMs?: number
  /** HTTPS for the ingress: PEM certificate (chain) and private key files the operator provides. */
  tls?: { certFile: string, keyFile: string }
  /** Latency budgets; defaults in DEFAULT_BUDGETS. */
  budgets?: Partial<Budgets>
  /**
   * Speculative decoding for the whole models this node serves: a draft model directory
   * (checkpoint or shard directory with the target's tokenizer), 'lookup' (prompt lookup, no
   * model) or 'none' (no speculation). Absent: prompt lookup by default on the whole models whose
   * shards verify exactly, for greedy and unseeded requests (daemon/speculative default.ts).
   */
  draft?: string
  /**
   * MiB of KV kept from finished requests for prefix reuse (--kv-cache-mb); 0 turns reuse off;
   * absent: derived from the memory free at boot (daemon/kv defaultKvCacheBytes).
   */
  kvCacheMb?: number
  /**
   * Be an expert holder (--hold-experts DIR): keep experts of this expert-parallel shard directory
   * (`shoal shard --experts`) resident for stage nodes, loading each the first time a stage sends
   * it rows, within `memoryMb` MiB (--expert-memory-mb; default: every expert of the directory).
   */
  holdExperts?: { dir: string, memoryMb?: number }
  /**
   * The components' own settings, no flags of their own: each field absent keeps the component's
   * default (daemon/routing DEFAULT_POLICY, DEFAULT_CHAIN_POLICY and DEFAULT_PREFIX_ROUTE_POLICY,
   * daemon/mesh DEFAULT_TIMINGS, daemon/ingress DEFAULT_INGRESS_LIMITS). `routing.prefix` says how
   * much prefill a prefix holder must save to be preferred (a huge `minSavedMs` never prefers one:
   * the chosen node is then told the holder and may pull the prefix from it instead).
   */
  routing?: { replica?: Partial<RoutingPolicy>, chain?: Partial<ChainPolicy>, prefix?: Partial<PrefixRoutePolicy> }
  meshTimings?: Partial<MeshTimings>
  ingress?: Partial<IngressLimits>
  /**
   * How the pipeline chains this node coordinates send activations between stages
   * (--activations): 'f32' (default) is exact; 'f16' and 'int8' (per-row scale) are lossy and
   * halve or quarter the bytes on every hop (daemon/pipeline/activations.ts).
   */
  activations?: 'f32' | 'f16' | 'int8'
  /**
   * Which kernels models run on (--kernels): 'auto' (default) shoal's own for int4 products and
   * the one-position attention where the machine builds them and they pass their self-check
   * (daemon/engine/native), else onnxruntime's; 'onnxruntime' always onnxruntime's, as shoal ran
   * before it had its own.
   */
  kernels?: KernelsMode
  /**
   * Route a prompt to the peer holding its prefix when that saves more prefill than it waits
   * (default true); false: routing ignores what nodes keep (for comparison, e.g. benchmarks).
   */
  prefixRouting?: boolean
  /**
   * Warm the whole-model engines up before the API listens (daemon/node/warm-up.ts: a few
   * requests, at most 1 s, leaving no receipt, metric or kept prefix), so that the first client
   * request runs as fast as the ones after it. `shoal serve`, `shoal node` and `shoal demo` set it
   * (`true`: WARM_UP's plan); a plan of its own is for tests, whose timing a loaded machine skews.
   * Absent: no warm-up.
   */
  warmUp?: boolean | WarmUpPlan
}

/** Which kernels a node runs (DaemonConfig.kernels). */
export type KernelsMode = 'auto' | 'onnxruntime'
export const KERNELS_MODES: readonly KernelsMode[] = ['auto', 'onnxruntime']

export class ConfigError extends ShoalError {
  override name = 'ConfigError'
  readonly key: string
  constructor (key: string, message: string) {
    super('SHOAL_ERR_CONFIG', `${key}: ${message}`)
    this.key = key
  }
}

const DEVICES = ['auto', 'cpu', 'CPU', 'GPU', 'NPU', 'AUTO']

/** "HOST:PORT", "[v6]:PORT" or ":PORT" (loopback). */
export function parseApiAddress (value: string, key = '--api'): { host: string, port: number } {
  const m = /^(?:\[([^\]]+)\]|([^:]*)):(\d{1,5})$/.exec(value)
  if (m === null) throw new ConfigError(key, `expected HOST:PORT, got "${value}"`)
  const port = Number(m[3])
  if (port > 65535) throw new ConfigError(key, `port ${port} is out of range`)
  const host = m[1] ?? (m[2] === '' ? '127.0.0.1' : m[2]!)
  return { host, port }
}

/** "DIR" or "DIR@A-B". A '@' followed by something that is not a layer range is part of the path. */
export function parseModelEntry (value: string, key = '--model'): ModelEntry {
  const m = /^(.*)@(\d+)-(\d+)$/.exec(value)
  if (m === null) return { dir: value }
  const first = Number(m[2])
  const last = Number(m[3])
  if (last < first) throw new ConfigError(key, `layer range ${first}-${last} is empty`)
  return { dir: m[1]!, layers: [first, last] }
}

export function validateConfig (input: DaemonConfig): Readonly<DaemonConfig> {
  // One device, or one per stage of a local chain ("cpu,GPU").
  for (const device of input.device.split(',').map(d => d.trim())) {
    if (!DEVICES.includes(device)) throw new ConfigError('--device', `"${device}" is not one of ${DEVICES.join(', ')} (or a comma-separated list of them, one per stage)`)
  }
  if (input.models.length === 0 && input.identityDir === undefined) throw new ConfigError('--model', 'serving needs a model directory')
  // One /shoal/stage handler per node: a node serves at most one pipeline stage.
  if (input.models.filter(m => m.layers !== undefined).length > 1) throw new ConfigError('--model', 'a node serves at most one pipeline stage (one DIR@A-B)')
  if (input.requireKeys === true && input.identityDir === undefined && input.caFile === undefined) {
    throw new ConfigError('--require-keys', 'needs a CA to check keys against: --ca FILE (ca.cert.json), or run `shoal node --identity DIR`')
  }
  if (input.requireKeys === true && input.api === undefined) throw new ConfigError('--require-keys', 'needs an HTTP ingress (--api HOST:PORT)')
  if (input.tls !== undefined) {
    if (input.tls.certFile === '' || input.tls.certFile === undefined) throw new ConfigError('--tls-cert', 'HTTPS needs both --tls-cert FILE and --tls-key FILE')
    if (input.tls.keyFile === '' || input.tls.keyFile === undefined) throw new ConfigError('--tls-key', 'HTTPS needs both --tls-cert FILE and --tls-key FILE')
    if (input.api === undefined) throw new ConfigError('--tls-cert', 'HTTPS is for the HTTP ingress: give --api HOST:PORT too')
  }
  if (input.witnessIntervalMs !== undefined && !(Number.isFinite(input.witnessIntervalMs) && input.witnessIntervalMs > 0)) {
    throw new ConfigError('witnessIntervalMs', `expected a positive number of milliseconds, got ${String(input.witnessIntervalMs)}`)
  }
  if (input.kvCacheMb !== undefined && (!Number.isSafeInteger(input.kvCacheMb) || input.kvCacheMb < 0)) {
    throw new ConfigError('--kv-cache-mb', `expected a whole number of MiB (0: no prefix reuse), got ${String(input.kvCacheMb)}`)
  }
  if (input.holdExperts !== undefined) {
    if (input.identityDir === undefined) throw new ConfigError('--hold-experts', 'an expert holder serves stage nodes over the mesh: run `shoal node --identity DIR`')
    const mb = input.holdExperts.memoryMb
    if (mb !== undefined && !(Number.isFinite(mb) && mb > 0)) throw new ConfigError('--expert-memory-mb', `expected a positive number of MiB, got ${String(mb)}`)
  }
  if (input.kernels !== undefined && !KERNELS_MODES.includes(input.kernels)) {
    throw new ConfigError('--kernels', `expected ${KERNELS_MODES.join(' or ')}, got ${String(input.kernels)}`)
  }
  if (input.activations !== undefined && !['f32', 'f16', 'int8'].includes(input.activations)) {
    throw new ConfigError('--activations', `expected f32, f16 or int8, got ${String(input.activations)}`)
  }
  const budgets = { ...DEFAULT_BUDGETS, ...checkSection('budgets', input.budgets ?? {}, DEFAULT_BUDGETS, true) }
  const routing = input.routing === undefined
    ? undefined
    : {
        ...(input.routing.replica === undefined ? {} : { replica: checkSection('routing.replica', input.routing.replica, DEFAULT_POLICY) }),
        ...(input.routing.chain === undefined ? {} : { chain: checkSection('routing.chain', input.routing.chain, DEFAULT_CHAIN_POLICY) }),
        ...(input.routing.prefix === undefined ? {} : { prefix: checkSection('routing.prefix', input.routing.prefix, DEFAULT_PREFIX_ROUTE_POLICY) }),
      }
  const meshTimings = input.meshTimings === undefined ? undefined : checkSection('meshTimings', input.meshTimings, DEFAULT_TIMINGS, true)
  const ingress = input.ingress === undefined ? undefined : checkSection('ingress', input.ingress, DEFAULT_INGRESS_LIMITS, true)
  const abs = (p: string): string => isAbsolute(p) ? p : resolve(p)
  const models = input.models.map(m => Object.freeze(m.dir === 'demo' ? { ...m } : { ...m, dir: abs(m.dir) }))
  if (input.draft !== undefined && input.draft.length === 0) throw new ConfigError('--draft', 'expected a draft model directory, "lookup" or "none"')
  const draft = input.draft === undefined || input.draft === 'lookup' || input.draft === 'none' || input.draft === 'demo' ? input.draft : abs(input.draft)
  return Object.freeze({
    ...input,
    models: Object.freeze(models) as ModelEntry[],
    ...(draft === undefined ? {} : { draft }),
    dataDir: abs(input.dataDir),
    cacheRoot: abs(input.cacheRoot),
    listen: Object.freeze([...input.listen]) as string[],
    bootstrap: Object.freeze([...input.bootstrap]) as string[],
    ...(input.announce === undefined ? {} : { announce: Object.freeze([...input.announce]) as string[] }),
    ...(input.identityDir === undefined ? {} : { identityDir: abs(input.identityDir) }),
    ...(input.revocationsFile === undefined ? {} : { revocationsFile: abs(input.revocationsFile) }),
    ...(input.caFile === undefined ? {} : { caFile: abs(input.caFile) }),
    ...(input.holdExperts === undefined ? {} : { holdExperts: Object.freeze({ ...input.holdExperts, dir: abs(input.holdExperts.dir) }) }),
    ...(input.tls === undefined ? {} : { tls: Object.freeze({ certFile: abs(input.tls.certFile), keyFile: abs(input.tls.keyFile) }) }),
    budgets: Object.freeze(budgets),
    ...(routing === undefined ? {} : { routing: Object.freeze(routing) }),
    ...(meshTimings === undefined ? {} : { meshTimings }),
    ...(ingress === undefined ? {} : { ingress }),
  })
}

/**
 * A component's settings section: only keys the component knows (a typo is an error, not a
 * silent default), each a finite number, not negative (`positive`: above 0). Returned frozen.
 */
function checkSection<T extends object> (key: string, section: Partial<T>, defaults: Readonly<T>, positive = false): Readonly<Partial<T>> {
  for (const [name, value] of Object.entries(section)) {
    if (!Object.hasOwn(defaults, name)) throw new ConfigError(`${key}.${name}`, `unknown setting; known: ${Object.keys(defaults).join(', ')}`)
    if (value === undefined) continue
    if (typeof value !== 'number' || !Number.isFinite(value) || value < 0 || (positive && value === 0)) {
      throw new ConfigError(`${key}.${name}`, `expected a ${positive ? 'positive' : 'non-negative'} number, got ${String(value)}`)
    }
  }
  return Object.freeze({ ...section })
}
