/**
 * The InferenceService of a pipeline-sharded model, run on the coordinator (the node holding
 * stage 0 and the tokenizer). Per request: tokenize, form the cheapest complete chain (stage 0 is
 * always this node), open the request along it, emit `start` with the chain's peer ids in order,
 * then deltas and `end` from the decode loop over a chain token source. An incomplete chain is an
 * error before `start` naming the missing layers; a lost stage mid-request is replayed on another
 * holder when there is one.
 *
 * Prefix reuse (when stage 0's node keeps prefixes; speculating requests too): a finished
 * request's KV stays on every stage of its chain under a key this coordinator indexes
 * (prefix-index.ts, over daemon/kv's prefix cache, scoped to the chain: chain-prefix.ts); a later
 * prompt sharing a kept prefix, on the same chain, opens every stage from it and prefills only the rest (at least
 * two positions, as for whole models). Only prompt positions are kept by default, which is
 * bit-for-bit what recomputation gives; `reuseGenerated` keeps the reply too (see local-service.ts
 * for its last-bit caveat). A stage that evicted the key answers so and the request is prefilled
 * whole instead. A follow-up sent the moment a response ended waits (bounded) for the stages to
 * acknowledge keeping its prefix rather than overtake their keeps. The start event says
 * `prefix: "reused"`; /metrics counts hit and miss tokens.
 * `prefixSummary` says in the load reply which prompts this coordinator's chains keep, hashed in
 * the model's whole scope (what a router computes for a chain's entry point), so a follow-up is
 * routed to the coordinator whose chains hold its history.
 */
import type { Registry } from 'prom-client'
import { ShoalError, ShuttingDownError } from '../errors.ts'
import type { PrefixCacheStats } from '../kv/index.ts'
import { OverloadedError, createGenerationService, waitTurn } from '../engine/index.ts'
import { ChainIncompleteError, formChain, runsKernels } from '../routing/index.ts'
import type { ChainContext, ChainPolicy, StageHolder } from '../routing/index.ts'
import type { PrefixSummary, RequestTicket, TokenSource, Turn } from '../engine/index.ts'
import type { ShardManifest } from '../../shards/index.ts'
import type { GenerateRequest, InferenceService, ModelCard, SpeculationSummary } from '../service.ts'
import { loadTextCodec } from '../text/index.ts'
import type { TextCodec } from '../text/index.ts'
import { createChainTokenSource } from './chain-source.ts'
import type { ChainTokenSource, ChainTokenSourceInit } from './chain-source.ts'
import { createChainPrefixIndex } from './prefix-index.ts'
import type { ChainPrefixIndex } from './prefix-index.ts'
import type { PipelineStage } from './stage.ts'
import type { ChainHop } from './wire.ts'
import { chainEncoding } from './activations.ts'
import type { ActivationEncoding } from './activations.ts'

/** How long the coordinator waits for the stages' signed receipt parts after the last token. */
const PART_WAIT_MS = 2_000

export interface PipelineServiceInit {
  /** This node's stage 0 (started by the caller). */
  stage: PipelineStage
  shardDir: string
  description?: string
  /** Longest wait for one token from the chain (default 30 s). */
  idleTimeoutMs?: number
  maxReplays?: number
  /** Concurrent requests coordinated here (default: stage 0's engine capacity, 8). */
  maxRequests?: number
  chainPolicy?: Partial<ChainPolicy>
  /**
   * The chain's context limit when below the model's: the smallest any stage holds (a stage on
   * static graphs holds its KV budget). Default: stage 0's (PipelineStage.manifest).
   */
  maxContextTokens?: number
  /**
   * Replaces each request's token source over its chain (speculative decoding, daemon/speculative,
   * plugs in here without the pipeline depending on it); started and stopped with the service.
   */
  sourceWrapper?: ChainSourceWrapper
  /**
   * shoal's kernels every stage of a wrapped (speculating) request's chain must run, where its
   * verify is exact only so (an int8-activation model: int4 and verify,
   * daemon/speculative/exact.ts). A request for which no such chain forms runs plainly.
   */
  speculationKernels?: readonly string[]
  /**
   * Whether a speculating request takes a chain of stages that run `speculationKernels` even where
   * a cheaper chain's do not (default: yes, as `--draft` asks). false (the default prompt lookup,
   * which must not move a request): it takes the chain it would take plainly, and speculates only
   * while every stage of that chain runs them.
   */
  speculationSteers?: boolean
  /** shoal's kernels this node's own stage runs (as its capabilities say: its place in the chains it forms). */
  kernels?: readonly string[]
  /** The activation encoding of the chains this coordinator opens (default 'f32', exact; see ChainTokenSourceInit). */
  activations?: ActivationEncoding
  /** Where the prefix metrics go (one /metrics page). */
  metrics?: Registry
  /** Tokens per hashed prefix block (daemon/kv DEFAULT_BLOCK_SIZE otherwise); also the least reused. */
  prefixBlockSize?: number
  /** Keep the KV of generated tokens too, so a chat's next turn prefills only its new message (see local-service.ts). */
  reuseGenerated?: boolean
  /** Longest wait of an open from a kept prefix for its stages' keeps still under way (ChainTokenSourceInit.keptWaitMs). */
  keptWaitMs?: number
}

/** What a chain source wrapper gets for one request. */
export interface ChainWrapContext {
  request: GenerateRequest
  manifest: ShardManifest
  /** The request's chain: prefill / decode, and verify (a token and its drafts in one traversal). */
  chain: Pick<ChainTokenSource, 'prefill' | 'decode' | 'verify'>
}

export interface ChainSourceWrapper {
  start? (target: { modelId: string, manifest: ShardManifest }): Promise<void>
  stop? (): Promise<void>
  /** Whether a request is wrapped (default: every one); one that is not decodes plainly over any chain. */
  wraps? (request: GenerateRequest): boolean
  /** A request's token source; `close` runs when the request ends, before the chain is closed. */
  wrapChain (ctx: ChainWrapContext): TokenSource & { close?: () => Promise<void>, summary?: () => SpeculationSummary }
}

export interface PipelineServiceComponents {
  /** Stage holders in the mesh (capabilities + load + RTT), this node excluded. */
  holders (): StageHolder[]
  /** Tells when the mesh stops hearing from a stage peer (see ChainTokenSourceInit.peerLost). */
  peerLost?: ChainTokenSourceInit['peerLost']
}

export interface PipelineServiceStats {
  activeRequests: number
  /** Requests waiting for a chain slot (only those routing sent here as the last node: `soleServer`). */
  waitingRequests: number
  /**
   * The coordinator's index of prefixes its chains keep (absent when reuse is off). hitTokens and
   * missTokens count prompt positions each request took from a kept prefix and prefilled.
   */
  prefix?: PrefixCacheStats & { refused: number }
}

export interface PipelineService extends InferenceService {
  start (): Promise<void>
  stop (): Promise<void>
  stats (): PipelineServiceStats
  /**
   * What this coordinator's chains keep, for its load reply (absent or undefined: nothing to say):
   * compact block hashes of the kept prompts in the model's whole scope (manifest hash, every
   * layer, float32) with DEFAULT_BLOCK_SIZE blocks, as routing hashes a prompt for an entry point.
   */
  prefixSummary? (max?: number): PrefixSummary | undefined
  /** The prompt's token ids as this model's tokenizer and chat template give them (what routing hashes). */
  promptTokens? (request: GenerateRequest, signal?: AbortSignal): Promise<number[]>
}

export function createPipelineService (init: PipelineServiceInit, components: PipelineServiceComponents): PipelineService {
  const { stage } = init
  const { node } = stage
  // Prompts and completions end at the chain's context limit, so a stage with a smaller KV budget
  // (static graphs) ends a completion with 'length' rather than failing it mid-stream.
  const manifest = init.maxContextTokens === undefined || init.maxContextTokens >= stage.manifest.shape.maxPositions
    ? stage.manifest
    : { ...stage.manifest, shape: { ...stage.manifest.shape, maxPositions: init.maxContextTokens } }
  const modelId = node.modelId
  const maxRequests = init.maxRequests ?? 8
  let codec: TextCodec | undefined
  let created = 0
  let active = 0
  /**
   * Requests routing sent here as the last node that could take them (`soleServer`), waiting for
   * a chain slot in arrival order, at most maxRequests of them: a slot passes straight from a
   * finished request to the first. Anyone else is refused at once when every slot is busy — the
   * refusal is what lets routing place it elsewhere; a sole server has nowhere else to send it, so
   * it waits until the request's deadline (as the local service's slots do: admission.ts
   * `ownWaitBudget`).
   */
  const waiters: Turn[] = []
  /** The index of what this coordinator's chains keep (set at start when stage 0 keeps prefixes). */
  let prefix: ChainPrefixIndex | undefined

  /** A lossy encoding only where every later stage of the chain declares it accepts it. */
  function encodingFor (chain: ChainHop[], requested: ActivationEncoding): ActivationEncoding {
    const holders = components.holders()
    return chainEncoding(requested, chain.slice(1).map(h => h.peerId), peerId => holders.find(h => h.peerId === peerId)?.activations)
  }

  /** The cheapest chain whose stage 0 is this node (or the one keeping the prompt's prefix, while it is worth it). */
  function chainFor (exclude: readonly string[], prefer?: ChainContext['prefer'], kernels?: readonly string[]): ChainHop[] {
    const self = stage.served()
    const holders: StageHolder[] = components.holders()
      .filter(h => h.peerId !== node.peerId && h.layers[0] !== 0)
      .concat({ peerId: node.peerId, modelId, manifestHash: stage.manifestHash, layers: self.layers, admitted: true, alive: true, rttMs: 0, ...(init.kernels === undefined ? {} : { kernels: init.kernels }) })
    const d = formChain(holders, {
      now: Date.now(),
      modelId,
      numLayers: manifest.shape.numLayers,
      manifestHash: stage.manifestHash,
      exclude,
      ...(init.chainPolicy === undefined ? {} : { policy: init.chainPolicy }),
      ...(prefer === undefined ? {} : { prefer }),
      ...(kernels === undefined ? {} : { kernels }),
    })
    if (d.kind === 'chain') return d.stages.map(s => ({ peerId: s.peerId, layers: [s.layers[0], s.layers[1]] }))
    if (d.kind === 'overloaded') throw new OverloadedError(d.reason)
    throw new ChainIncompleteError(d.reason)
  }

  /** Whether every stage of `chain`, this node's included, says it runs `kernels`. */
  function runsAll (chain: readonly ChainHop[], kernels: readonly string[]): boolean {
    const holders = components.holders()
    return chain.every(hop => {
      const holder = hop.peerId === node.peerId
        ? { ...(init.kernels === undefined ? {} : { kernels: init.kernels }) }
        : holders.find(h => h.peerId === hop.peerId && h.layers[0] === hop.layers[0] && h.layers[1] === hop.layers[1])
      return runsKernels(holder ?? {}, kernels)
    })
  }

  /**
   * A request's chain: a coordinator slot (refused when all are busy, unless routing marked the
   * request `soleServer`: it then waits for one, see `waiters`), then its chain token source.
   */
  function admit (request: GenerateRequest, promptIds: number[]): RequestTicket {
    const sole = request.soleServer === true
    if (active >= maxRequests && !(sole && waiters.length < maxRequests)) {
      throw new OverloadedError(`all ${maxRequests} chain slots of this coordinator are busy${sole ? ` and ${waiters.length} requests are already waiting` : ''}`)
    }
    /** Whether this request holds a slot (one it took now, or was handed while it waited). */
    let holding = active < maxRequests
    if (holding) active++
    /** Waits for a slot until `signal` (the request's scope: its deadline or its client) aborts. */
    const slot = async (signal: AbortSignal): Promise<void> => {
      if (!holding) await waitTurn(waiters, {}, signal, () => { holding = true })
    }
    /** Tokens fed to the chain so far: the prompt, then each generated id. */
    const fed = [...promptIds]
    // Under speculative decoding too: the wrapper prefills through the chain (ChainWrapContext), so
    // from a kept prefix like any request, and verify steps write only positions past the prompt.
    const index = prefix
    const reuse = index?.forRequest(promptIds, fed)
    const hooks = reuse?.hooks
    let source: ChainTokenSource | undefined
    let wrapped: (TokenSource & { close?: () => Promise<void>, summary?: () => SpeculationSummary }) | undefined
    return {
      async open (signal) {
        await slot(signal)
        // A wrapped request speculates only over chains whose every stage runs the kernels its
        // verify needs to be exact (init.speculationKernels), replays included.
        const speculates = init.sourceWrapper !== undefined && init.sourceWrapper.wraps?.(request) !== false
        const kernels = speculates ? init.speculationKernels : undefined
        /**
         * Where no chain of such holders forms, the request decodes plainly over any chain: from the
         * start when that is at its open (no token drawn yet: it is then not wrapped at all); from a
         * replay on only for a greedy or unseeded request, whose verify steps then become plain
         * steps (no draft accepted: each token is the plain step's own, which keeps greedy ids and
         * the distribution), while a seeded sampled one keeps to kernel chains or fails cleanly
         * (plain steps would draw differently).
         */
        let plainOnly = false
        let connected = false
        const fallsBack = request.sampling.temperature <= 0 || request.sampling.seed === undefined
        const formOnce = (exclude: readonly string[]): ChainHop[] => {
          // A chain that keeps this prompt's prefix is asked for again while it is worth its cost.
          const prefer = index?.preferred(promptIds)
          if (kernels === undefined || plainOnly) return chainFor(exclude, prefer)
          if (init.speculationSteers === false) {
            // Wrapped requests are then greedy or unseeded ones (the default lookup's), so a chain
            // without the kernels, at the open or a replay, makes the rest plain.
            const hops = chainFor(exclude, prefer)
            if (!runsAll(hops, kernels)) plainOnly = true
            return hops
          }
          try {
            return chainFor(exclude, prefer, kernels)
          } catch (err) {
            if ((connected && !fallsBack) || !(err instanceof ChainIncompleteError || err instanceof OverloadedError)) throw err
            plainOnly = true
            return chainFor(exclude, prefer)
          }
        }
        const chain = createChainTokenSource({
          node,
          requestId: request.requestId,
          sampling: request.sampling,
          deadline: request.deadline,
          formChain: formOnce,
          ...(components.peerLost === undefined ? {} : { peerLost: components.peerLost }),
          ...(init.idleTimeoutMs === undefined ? {} : { idleTimeoutMs: init.idleTimeoutMs }),
          ...(init.maxReplays === undefined ? {} : { maxReplays: init.maxReplays }),
          ...(init.activations === undefined || init.activations === 'f32'
            ? {}
            : { activations: init.activations, encodingFor: (chain: ChainHop[]) => encodingFor(chain, init.activations!) }),
          ...(hooks === undefined ? {} : { prefix: hooks }),
          ...(init.keptWaitMs === undefined ? {} : { keptWaitMs: init.keptWaitMs }),
        })
        source = chain
        await chain.connect(signal)
        connected = true
        const began = performance.now()
        const target: ChainWrapContext['chain'] = {
          prefill: async (ids, signal) => await chain.prefill(ids, signal),
          decode: async (token, position, signal) => await chain.decode(token, position, signal),
          verify: async (token, position, drafts, signal) => plainOnly
            ? { accepted: 0, next: await chain.decode(token, position, signal) }
            : await chain.verify(token, position, drafts, signal),
        }
        const w = speculates && !plainOnly ? init.sourceWrapper?.wrapChain({ request, manifest, chain: target }) : undefined
        wrapped = w
        return {
          source: w ?? chain,
          prefilled: () => {
            const hit = chain.reused
            index?.prefilled({ scope: reuse?.scope(), hit, promptLength: promptIds.length, request, ms: performance.now() - began })
          },
          // `start` names the chain that answered the prefill.
          start: () => ({
            route: chain.route,
            hops: chain.hops,
            manifestHash: stage.manifestHash,
            receiptId: request.requestId,
            // On a rebuilt chain, `movedFrom` names the peers its moved stages pulled their layers from.
            ...(chain.reused > 0 ? { prefix: { peerId: node.peerId, reusedTokens: chain.reused, ...(chain.movedFrom.length === 0 ? {} : { movedFrom: chain.movedFrom.join(',') }) } } : {}),
          }),
          delta: tokenIds => { fed.push(...tokenIds) },
          summary: () => w?.summary?.(),
          // Each stage's signed share of the work, collected before the end goes out (bounded wait:
          // a stage that does not answer is left out; its hop still names it in the receipt).
          end: async (event, signal) => {
            const parts = await chain.finish(AbortSignal.any([signal, AbortSignal.timeout(PART_WAIT_MS)]))
            return parts.length === 0 ? event : { ...event, receiptParts: [...(event.receiptParts ?? []), ...parts] }
          },
        }
      },
      async release () {
        if (holding) {
          holding = false
          const next = waiters.shift()
          if (next === undefined) active--
          else next.grant()
        }
        await wrapped?.close?.().catch(() => {})
        await source?.close()
      },
    }
  }

  const { generate } = createGenerationService({
    current: () => codec === undefined ? undefined : { modelId, codec, manifest },
    notRunning: 'the pipeline service is not running',
    admit,
  })

  return {
    async promptTokens (request, signal) {
      if (codec === undefined) throw new ShuttingDownError('the pipeline service is not running')
      return await codec.encodePromptAsync(request.prompt, signal)
    },
    prefixSummary (max = 64) {
      return prefix?.summary(max)
    },
    async start () {
      if (stage.stageIndex !== 0) throw new ShoalError('SHOAL_ERR_STAGE_CONFIG', 'only the node holding stage 0 (with the tokenizer) coordinates a chain')
      codec = await loadTextCodec(init.shardDir, manifest)
      await init.sourceWrapper?.start?.({ modelId, manifest })
      const budget = node.stats().prefixes?.budgetBytes ?? 0
      prefix = node.keepsPrefixes && budget > 0
        ? createChainPrefixIndex({
            node,
            manifestHash: stage.manifestHash,
            numLayers: stage.manifest.shape.numLayers,
            modelId,
            budgetBytes: budget,
            ...(init.prefixBlockSize === undefined ? {} : { blockSize: init.prefixBlockSize }),
            ...(init.metrics === undefined ? {} : { metrics: init.metrics }),
            ...(init.reuseGenerated === undefined ? {} : { reuseGenerated: init.reuseGenerated }),
          })
        : undefined
      created = Math.floor(Date.now() / 1000)
    },
    async stop () {
      const c = codec
      codec = undefined
      for (const w of waiters.splice(0)) w.fail(new ShuttingDownError('the pipeline service is stopping'))
      prefix?.close()
      prefix = undefined
      await c?.close()
      await init.sourceWrapper?.stop?.()
    },
    models (): ModelCard[] {
      if (codec === undefined) return []
      const description = init.description ?? manifest.description
      return [{ id: modelId, created, ownedBy: 'shoal', contextLength: manifest.shape.maxPositions, ...(description === undefined ? {} : { description }), servedBy: [node.peerId] }]
    },
    generate,
    stats: () => {
      return { activeRequests: active, waitingRequests: waiters.length, ...(prefix === undefined ? {} : { prefix: prefix.stats() }) }
    },
  }
}
