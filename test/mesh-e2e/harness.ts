/**
 * Fixture for the mesh end-to-end tests: real mesh daemons on loopback (createDaemon with an
 * identity, exactly what `shoal node` runs), in this process or as child processes of the real
 * CLI (`node scripts/shoal.mjs node …`) so one can be SIGKILLed. Identities come from a throwaway
 * CA; every node listens on loopback QUIC + TCP with mdns off and bootstraps to the first node.
 */
import { spawn } from 'node:child_process'
import type { ChildProcess } from 'node:child_process'
import { join } from 'node:path'
import { createInterface } from 'node:readline'
import { fileURLToPath } from 'node:url'
import OpenAI from 'openai'
import { pino } from 'pino'
import { createDaemon, validateConfig } from '../../daemon/node/index.ts'
import type { Daemon, DaemonConfig } from '../../daemon/node/index.ts'

export const LOOPBACK_LISTEN = ['/ip4/127.0.0.1/udp/0/quic-v1', '/ip4/127.0.0.1/tcp/0']
const SHOAL_BIN = fileURLToPath(new URL('../../scripts/shoal.mjs', import.meta.url))

export interface MeshNode {
  name: string
  peerId: string
  /** libp2p multiaddrs with /p2p/<peerId>. */
  addrs: string[]
  /** API base URL (no /v1), when the node has an API. */
  url?: string
  stop (): Promise<void>
}

/** An OpenAI client for `url` that never retries (a retry would hide a 429/503) with a hard timeout. */
export function clientFor (url: string, timeoutMs = 60_000): OpenAI {
  return new OpenAI({ baseURL: `${url}/v1`, apiKey: 'unused', maxRetries: 0, timeout: timeoutMs })
}

/** Starts a mesh daemon in this process. */
export async function startInProcess (opts: { name: string, identityDir: string, root: string, model?: string, api: boolean, bootstrap: string[], budgets?: DaemonConfig['budgets'], config?: Partial<DaemonConfig>, random?: () => number }): Promise<MeshNode & { daemon: Daemon }> {
  const daemon = createDaemon(validateConfig({
    identityDir: opts.identityDir,
    models: opts.model === undefined ? [] : [{ dir: opts.model }],
    ...(opts.api ? { api: { host: '127.0.0.1', port: 0 } } : {}),
    device: 'cpu',
    dataDir: join(opts.root, `data-${opts.name}`),
    cacheRoot: join(opts.root, 'cache'),
    listen: LOOPBACK_LISTEN,
    bootstrap: opts.bootstrap,
    mdns: false,
    ...(opts.budgets === undefined ? {} : { budgets: opts.budgets }),
    ...opts.config,
  }), { logger: pino({ level: 'silent' }), ...(opts.random === undefined ? {} : { random: opts.random }) })
  const { peerId, apiUrl } = await daemon.start()
  let stopped: Promise<void> | undefined
  return {
    name: opts.name,
    peerId,
    addrs: daemon.mesh!.libp2p.getMultiaddrs().map(a => a.toString()),
    ...(apiUrl === undefined ? {} : { url: apiUrl }),
    daemon,
    stop: async () => { stopped ??= daemon.stop(); await stopped },
  }
}

export interface ChildNode extends MeshNode {
  child: ChildProcess
  /** Everything the child wrote to stderr (for failure messages). */
  stderr (): string
  kill (signal: NodeJS.Signals): void
  /** Resolves when the process has exited. */
  exited: Promise<void>
}

/**
 * Runs `shoal node` as a child process and waits (bounded) for its "node … up" banner and its
 * listen addresses. SHOAL_CACHE points at `cacheDir` so nothing touches the user's cache.
 */
export async function spawnNode (opts: {
  name: string, identityDir: string, dataDir: string, cacheDir: string, model?: string, api?: string,
  bootstrap: string[], cpu?: number, startTimeoutMs?: number,
}): Promise<ChildNode> {
  const args = [SHOAL_BIN, 'node', '--identity', opts.identityDir, '--data', opts.dataDir, '--device', 'cpu', '--no-mdns']
  if (opts.model !== undefined) args.push('--model', opts.model)
  if (opts.api !== undefined) args.push('--api', opts.api)
  for (const l of LOOPBACK_LISTEN) args.push('--listen', l)
  for (const b of opts.bootstrap) args.push('--bootstrap', b)
  const [cmd, argv] = opts.cpu === undefined ? [process.execPath, args] : ['taskset', ['-c', String(opts.cpu), process.execPath, ...args]]
  const child = spawn(cmd, argv, { stdio: ['ignore', 'pipe', 'pipe'], env: { ...process.env, SHOAL_CACHE: opts.cacheDir, NODE_OPTIONS: '' } })
  let err = ''
  child.stderr!.on('data', (b: Buffer) => { err = (err + b.toString()).slice(-20_000) })
  const exited = new Promise<void>(resolve => {
    if (child.exitCode !== null || child.signalCode !== null) resolve()
    else child.once('exit', () => { resolve() })
  })
  const lines = createInterface({ input: child.stdout! })
  const banner = await new Promise<{ peerId: string, url?: string, addrs: string[] }>((resolve, reject) => {
    let peerId: string | undefined
    let url: string | undefined
    const addrs: string[] = []
    const timer = setTimeout(() => { child.kill('SIGKILL'); reject(new Error(`${opts.name} did not start within ${opts.startTimeoutMs ?? 60_000} ms: ${err}`)) }, opts.startTimeoutMs ?? 60_000)
    const done = (): void => { clearTimeout(timer); resolve({ peerId: peerId!, ...(url === undefined ? {} : { url }), addrs }) }
    lines.on('line', line => {
      const up = /^shoal: node (\S+) up(?:, API at (\S+)\/v1)?/.exec(line)
      if (up !== null) { peerId = up[1]; url = up[2]; return }
      const l = /^\s+listening on (\S+)/.exec(line)
      if (l !== null) {
        addrs.push(l[1]!)
        // The node prints one line per listen address, right after the banner.
        if (peerId !== undefined && addrs.length >= LOOPBACK_LISTEN.length) done()
      }
    })
    child.once('exit', (code, signal) => { clearTimeout(timer); reject(new Error(`${opts.name} exited (${code ?? signal}) before it was up: ${err}`)) })
  })
  return {
    name: opts.name,
    ...banner,
    child,
    exited,
    stderr: () => err,
    kill: (signal) => { if (child.exitCode === null && child.signalCode === null) child.kill(signal) },
    stop: async () => {
      if (child.exitCode === null && child.signalCode === null) {
        child.kill('SIGTERM')
        const t = setTimeout(() => { child.kill('SIGKILL') }, 10_000)
        await exited
        clearTimeout(t)
      }
    },
  }
}

/** Polls `check` until true; throws after `ms`. A deadline on a wait, not a timing assertion. */
export async function waitFor (what: string, check: () => boolean | Promise<boolean>, ms = 30_000): Promise<void> {
  const deadline = Date.now() + ms
  for (;;) {
    if (await check()) return
    if (Date.now() > deadline) throw new Error(`timed out after ${ms} ms waiting for ${what}`)
    await new Promise(resolve => setTimeout(resolve, 100))
  }
}

export interface MeshPeerJson {
  peerId: string
  name?: string
  admitted: boolean
  state: string
  models: Array<{ id: string, layers?: [number, number], drafter?: string }>
  load?: { inFlight: number, queueDepth: number, [k: string]: unknown }
  rttMs?: number
}
export interface MeshJson { self: { peerId: string, name: string }, peers: MeshPeerJson[] }

export async function meshOf (url: string): Promise<MeshJson> {
  const res = await fetch(`${url}/v1/mesh`, { signal: AbortSignal.timeout(10_000) })
  if (res.status !== 200) throw new Error(`GET /v1/mesh: ${res.status}`)
  return await res.json() as MeshJson
}

/** True when `url`'s node sees every one of `peerIds` admitted and alive, serving `model` when given. */
export async function sees (url: string, peerIds: string[], model?: string): Promise<boolean> {
  const mesh = await meshOf(url)
  return peerIds.every(id => mesh.peers.some(p => p.peerId === id && p.admitted && p.state === 'alive' && p.load !== undefined &&
    (model === undefined || p.models.some(m => m.id === model))))
}
