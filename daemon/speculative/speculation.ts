/**
 * Speculative decoding for a served model: a source wrapper that gives every request a
 * speculative token source, with a draft model (`--draft DIR`, its own engine worker beside the
 * target's, on the node where requests enter: the local service's node, or a chain's stage 0) or
 * prompt lookup as the drafter. `wrap` serves a whole model (daemon/engine's local service),
 * `wrapChain` a pipeline chain (daemon/pipeline's service: one traversal per verify, acceptance at
 * the last stage from token ids alone: greedy, or sampled with the drafts as point masses).
 */
import type { Registry } from 'prom-client'
import type { BackendName, TokenSource, TokenSourceWrapper } from '../engine/index.ts'
import type { GenerateRequest, SpeculationSummary } from '../service.ts'
import { EngineError } from '../engine/index.ts'
import { ShoalError } from '../errors.ts'
import type { ShardManifest } from '../../shards/index.ts'
import { createDraftModel } from './draft-model.ts'
import { DEFAULT_LOOKUP_MIN_NGRAM, DEFAULT_LOOKUP_NAME, defaultLookupMinNgram, defaultLookupTakes } from './default.ts'
import { inexactTarget } from './exact.ts'
import type { DraftModel } from './draft-model.ts'
import { createPromptLookupDrafter } from './drafter.ts'
import type { Drafter } from './drafter.ts'
import { createSpeculationMetrics } from './metrics.ts'
import { createSpeculativeSource } from './source.ts'
import type { SpeculationCounts, SpeculationOptions, SpeculativeSourceInit, Verifier } from './source.ts'

export interface SpeculationInit extends SpeculationOptions {
  /**
   * A whole-model shard directory with the target's tokenizer (`kernels`: shoal's kernel library
   * its graphs load, DraftModelInit.kernels), or prompt lookup.
   */
  drafter: { draftDir: string, kernels?: string } | 'prompt-lookup' | Drafter
  /**
   * Prompt lookup switched on by default (no `--draft`; the daemon picks the models with
   * default.ts): requests it would not keep their promise to (seeded sampled ones) run on the
   * engine's own source, and the drafter reports itself as DEFAULT_LOOKUP_NAME.
   */
  byDefault?: boolean
  backend?: BackendName
  device?: string
  /** shoal's kernels the target's graphs run here (capabilities' names): with int4 and verify, int8-activation targets speculate exactly (inexactTarget). */
  targetKernels?: readonly string[]
  threads?: number
  maxSequences?: number
  metrics?: Registry
  /** Each request's counts when it ends (tests, receipts). */
  onRequestEnd?: (requestId: string, counts: SpeculationCounts) => void
  /** The cost model's clock, in ms (default performance.now; tests pass a steady one so adaptive K does not follow the machine's load). */
  now?: () => number
}

/** A pipeline chain's request, structurally (daemon/pipeline's ChainWrapContext). */
export interface ChainTarget {
  request: GenerateRequest
  manifest: ShardManifest
  chain: {
    prefill (promptIds: number[], signal: AbortSignal): Promise<number>
    decode (tokenId: number, position: number, signal: AbortSignal): Promise<number>
    verify (tokenId: number, position: number, drafts: number[], signal: AbortSignal): Promise<{ accepted: number, next: number }>
  }
}

export interface Speculation extends TokenSourceWrapper {
  /** 'prompt-lookup', DEFAULT_LOOKUP_NAME or 'draft:<model id>' (after start for a draft model). */
  readonly drafterName: string
  /** Whether a chain request speculates (a default prompt lookup leaves seeded sampled ones plain, as `wrap` does). */
  wraps (request: GenerateRequest): boolean
  /** A chain request's source (the chain checks drafts and samples at its last stage); asked only where `wraps`. */
  wrapChain (ctx: ChainTarget): TokenSource & { close: () => Promise<void> }
}

/** A chain's verifier: one traversal per verify, acceptance at the last stage, rollback by start position on every stage. */
function chainVerifier (chain: ChainTarget['chain']): Verifier {
  return {
    // The last stage makes the draws with its own seeded generator.
    prefill: async (promptIds, _pick, signal) => await chain.prefill(promptIds, signal),
    plain: async (token, position, _pick, signal) => await chain.decode(token, position, signal),
    verify: async (token, position, drafts, _check, signal) => await chain.verify(token, position, drafts, signal),
  }
}

export function createSpeculation (init: SpeculationInit): Speculation {
  const metrics = createSpeculationMetrics(init.metrics)
  let draftModel: DraftModel | undefined
  let drafter: Drafter
  /** The default lookup's drafter by its shortest match (defaultLookupMinNgram: per target and mode). */
  const defaultLookups = new Map<number, Drafter>()
  const defaultLookup = (minNgram: number): Drafter => {
    let d = defaultLookups.get(minNgram)
    if (d === undefined) defaultLookups.set(minNgram, d = createPromptLookupDrafter({ name: DEFAULT_LOOKUP_NAME, minNgram }))
    return d
  }
  const byDefault = init.drafter === 'prompt-lookup' && init.byDefault === true
  if (init.drafter === 'prompt-lookup') drafter = byDefault ? defaultLookup(DEFAULT_LOOKUP_MIN_NGRAM) : createPromptLookupDrafter({})
  else if ('draftDir' in init.drafter) {
    draftModel = createDraftModel({
      shardDir: init.drafter.draftDir,
      ...(init.drafter.kernels === undefined ? {} : { kernels: init.drafter.kernels }),
      ...(init.backend === undefined ? {} : { backend: init.backend }),
      ...(init.device === undefined ? {} : { device: init.device }),
      ...(init.threads === undefined ? {} : { threads: init.threads }),
      ...(init.maxSequences === undefined ? {} : { maxSequences: init.maxSequences }),
      ...(init.metrics === undefined ? {} : { metrics: init.metrics }),
    })
    drafter = draftModel
  } else drafter = init.drafter
  let modelId = ''
  /** A default prompt lookup leaves seeded sampled requests plain (default.ts); an explicit drafter takes every one. */
  const wraps = (request: GenerateRequest): boolean => init.byDefault !== true || defaultLookupTakes(request.sampling)
  return {
    get drafterName () { return drafter.name },
    async start (target) {
      modelId = target.modelId
      const why = inexactTarget(target.manifest, init.targetKernels)
      if (why !== undefined) throw new ShoalError('SHOAL_ERR_CONFIG', `--draft: speculative decoding would not keep ${target.modelId}'s tokens exact: ${why}`)
      if (draftModel === undefined) return
      await draftModel.start()
      const d = draftModel.manifest!
      // Drafts are token ids of the target's vocabulary; a different one could only be wrong.
      if (d.shape.vocabSize !== target.manifest.shape.vocabSize) {
        await draftModel.stop()
        throw new EngineError(`draft model ${d.modelId} has a vocabulary of ${d.shape.vocabSize}; the target ${target.modelId} has ${target.manifest.shape.vocabSize}`)
      }
    },
    async stop () { await draftModel?.stop() },
    wraps,
    wrap (ctx) {
      if (!wraps(ctx.request)) return undefined
      const d = byDefault ? defaultLookup(defaultLookupMinNgram(ctx.manifest, false)) : drafter
      return sourceFor(ctx.seqId, ctx.request, ctx.manifest, d, { target: { step: ctx.step, rollback: ctx.rollback }, ...(ctx.peers === undefined ? {} : { peers: ctx.peers }), soloOnly: init.byDefault === true })
    },
    wrapChain (ctx) {
      // The default speculates beside other requests on a chain, unlike on a whole model (`wrap`'s
      // soloOnly): a round saves a traversal of every hop, and measured on a 3-stage chain with
      // two repeating and two non-repeating streams at once, the repeating ones went 3.9–8.4× and
      // the others 0.97–1.30× (results/speculative.md, wave 39).
      const d = byDefault ? defaultLookup(defaultLookupMinNgram(ctx.manifest, true)) : drafter
      return sourceFor(ctx.request.requestId, ctx.request, ctx.manifest, d, { verifier: chainVerifier(ctx.chain) })
    },
  }

  function sourceFor (seqId: string, request: GenerateRequest, manifest: ShardManifest, drafter: Drafter, target: Pick<SpeculativeSourceInit, 'target' | 'verifier' | 'peers' | 'soloOnly'>): TokenSource & { close: () => Promise<void>, summary: () => SpeculationSummary } {
    const labels = { model: modelId, drafter: drafter.name }
    const source = createSpeculativeSource({
      ...init,
      ...target,
      seqId,
      drafter,
      sampling: request.sampling,
      maxTokens: request.maxTokens,
      maxPositions: manifest.shape.maxPositions,
      vocabSize: manifest.shape.vocabSize,
      onRound (k, drafted, accepted) {
        metrics.rounds.inc(labels)
        metrics.drafted.inc(labels, drafted)
        metrics.accepted.inc(labels, accepted)
        metrics.k.observe(labels, k)
      },
      onDrafterFailure () { metrics.failures.inc(labels) },
    })
    return {
      prefill: source.prefill,
      decode: source.decode,
      summary: () => { const c = source.counts(); return { drafter: c.drafter, drafted: c.drafted, accepted: c.accepted } },
      async close () {
        await source.close()
        init.onRequestEnd?.(request.requestId, source.counts())
      },
    }
  }
}
