/**
 * A draft model as a Drafter: a second (small) whole-model shard directory with the target's
 * tokenizer, run in its own engine worker beside the target. Each sequence keeps the draft's KV
 * and the tokens behind it; a proposal first rolls that cache back to where it still agrees with
 * the sequence (rejected drafts), catches up on the verified tokens in one step, then drafts K
 * tokens one step each — greedily, or with sampling drawn from the draft's distribution q (which
 * speculative sampling needs).
 */
import type { Registry } from 'prom-client'
import { createBatcher } from '../batcher/index.ts'
import type { Batcher } from '../batcher/index.ts'
import { chooseStageGraphs, createBatchedExecutor, createStageEngine, EngineError, GREEDY_PICK, resolveGraphChoice, stageInfoOf } from '../engine/index.ts'
import type { BackendName, BatchingStageEngine, StepOptions, StepOutput } from '../engine/index.ts'
import { loadManifest } from '../../shards/index.ts'
import type { ShardManifest } from '../../shards/index.ts'
import { distribution, sampleFrom } from './acceptance.ts'
import type { Drafter, Proposal, SequenceDrafter } from './drafter.ts'

/** The draft's steps for one of its sequences (engine or batcher underneath). */
export interface DraftSteps {
  open (seqId: string, signal: AbortSignal): Promise<void>
  step (seqId: string, tokenIds: number[], positions: number[], options: StepOptions, signal: AbortSignal): Promise<StepOutput>
  rollback (seqId: string, length: number, signal: AbortSignal): Promise<void>
  free (seqId: string): Promise<void>
}

/** A Drafter over any draft steps (the draft-model service below, or a test's engine). */
export function draftModelDrafter (name: string, steps: DraftSteps): Drafter {
  return {
    name,
    async open (seqId, promptIds, signal) {
      const id = `${seqId}/draft`
      await steps.open(id, signal)
      /** Tokens whose KV the draft holds, in order. */
      const cached: number[] = []
      let closed = false
      try {
        // The whole prompt but its last token: the first proposal feeds that one and drafts from it.
        if (promptIds.length > 1) {
          const head = promptIds.slice(0, -1)
          await steps.step(id, head, head.map((_, i) => i), { logitsToKeep: 1, pick: GREEDY_PICK }, signal)
          cached.push(...head)
        }
      } catch (err) {
        await steps.free(id).catch(() => {})
        throw err
      }
      const drafter: SequenceDrafter = {
        async propose ({ context, k, sampling, rng, signal }): Promise<Proposal> {
          if (closed) throw new EngineError('draft sequence is closed')
          let common = 0
          while (common < cached.length && common < context.length && cached[common] === context[common]) common++
          // The last context token must be fed (its logits give the first draft).
          common = Math.min(common, context.length - 1)
          if (common < cached.length) { await steps.rollback(id, common, signal); cached.length = common }
          const greedy = sampling.temperature <= 0
          const tokens: number[] = []
          const q: Float64Array[] = []
          let feed = context.slice(common)
          for (let i = 0; i < k; i++) {
            const positions = feed.map((_, j) => cached.length + j)
            const out = await steps.step(id, feed, positions, greedy ? { logitsToKeep: 1, pick: GREEDY_PICK } : { logitsToKeep: 1 }, signal)
            cached.push(...feed)
            let t: number
            if (out.kind === 'token') t = out.id
            else if (out.kind === 'logits') {
              const row = distribution(out.data, sampling, (out.count - 1) * out.vocab, out.vocab)
              t = sampleFrom(row, rng())
              q.push(row)
            } else throw new EngineError(`draft step returned ${out.kind}`)
            tokens.push(t)
            feed = [t]
          }
          return greedy ? { tokens } : { tokens, q }
        },
        async close () {
          if (closed) return
          closed = true
          await steps.free(id)
        },
      }
      return drafter
    },
  }
}

export interface DraftModelInit {
  shardDir: string
  backend?: BackendName
  device?: string
  threads?: number
  maxSequences?: number
  /** Micro-batch the draft steps of concurrent sequences (default true). */
  batching?: boolean
  metrics?: Registry
  /** shoal's kernel library its graphs load on onnxruntime (LoadOptions.kernels); absent: onnxruntime's kernels. */
  kernels?: string
}

/** A draft model with its own engine worker (and micro-batcher): start, use as a Drafter, stop. */
export interface DraftModel extends Drafter {
  start (): Promise<void>
  stop (): Promise<void>
  /** After start. */
  readonly manifest: ShardManifest | undefined
}

export function createDraftModel (init: DraftModelInit): DraftModel {
  let manifest: ShardManifest | undefined
  let engine: BatchingStageEngine | undefined
  let batcher: Batcher | undefined
  let inner: Drafter | undefined
  const running = (): { engine: BatchingStageEngine, batcher: Batcher | undefined } => {
    if (engine === undefined) throw new EngineError('the draft model is not running')
    return { engine, batcher }
  }
  return {
    get name () { return inner?.name ?? 'draft' },
    get manifest () { return manifest },
    async start () {
      const m = await loadManifest(init.shardDir)
      const [stage] = m.stages
      if (m.stages.length !== 1 || stage === undefined || !stage.hasEmbedding || !stage.hasHead) {
        throw new EngineError(`${init.shardDir}: a draft model must be a whole-model (1-stage) shard directory`)
      }
      const backend = init.backend ?? 'onnxruntime'
      const device = init.device ?? 'CPU'
      // The dynamic graph (a drafter steps one sequence at a time), with its one-position graph
      // where that pays: a draft model is small, and drafting is one-position steps.
      const e = createStageEngine({
        ...resolveGraphChoice(init.shardDir, chooseStageGraphs(m, 0, device, 'dynamic', backend)),
        stage: stageInfoOf(m),
        backend,
        device,
        ...(init.threads === undefined ? {} : { threads: init.threads }),
        ...(init.maxSequences === undefined ? {} : { maxSequences: init.maxSequences }),
        ...(init.kernels === undefined ? {} : { kernels: init.kernels }),
      })
      await e.start()
      if (init.batching !== false) {
        batcher = createBatcher({ name: `draft:${m.modelId}` }, { executor: createBatchedExecutor(e), ...(init.metrics === undefined ? {} : { metrics: init.metrics }) })
        await batcher.start()
      }
      engine = e
      manifest = m
      inner = draftModelDrafter(`draft:${m.modelId}`, {
        async open (seqId, signal) { await running().engine.open(seqId, signal) },
        async step (seqId, tokenIds, positions, options, signal) {
          const r = running()
          if (r.batcher === undefined) return await r.engine.step(seqId, { tokenIds }, positions, options, signal)
          return await r.batcher.submit({ seqId, kind: positions[0] === 0 ? 'prefill' : 'decode', input: { tokenIds }, positions, logitsToKeep: options.logitsToKeep ?? 1, ...(options.pick === undefined ? {} : { pick: options.pick }) }, signal)
        },
        async rollback (seqId, length, signal) { await running().engine.rollback(seqId, length, signal) },
        async free (seqId) {
          const r = running()
          r.batcher?.release(seqId)
          await r.engine.free(seqId)
        },
      })
    },
    async stop () {
      await batcher?.stop()
      batcher = undefined
      await engine?.stop()
      engine = undefined
    },
    async open (seqId, promptIds, signal) {
      if (inner === undefined) throw new EngineError('the draft model is not running')
      return await inner.open(seqId, promptIds, signal)
    },
  }
}
