/**
 * Speculative decoding for a local (whole-model) service: a TokenSourceWrapper that gives every
 * request a speculative token source over the request's target sequence, with a draft model
 * (`--draft DIR`, its own engine worker beside the target's) or prompt lookup as the drafter.
 */
import type { Registry } from 'prom-client'
import type { BackendName, TokenSourceWrapper } from '../engine/index.ts'
import { EngineError } from '../engine/index.ts'
import { ShoalError } from '../errors.ts'
import type { ShardManifest } from '../../shards/index.ts'
import { createDraftModel } from './draft-model.ts'
import type { DraftModel } from './draft-model.ts'
import { createPromptLookupDrafter } from './drafter.ts'
import type { Drafter } from './drafter.ts'
import { createSpeculationMetrics } from './metrics.ts'
import { createSpeculativeSource } from './source.ts'
import type { SpeculationCounts, SpeculationOptions } from './source.ts'

export interface SpeculationInit extends SpeculationOptions {
  /** A whole-model shard directory with the target's tokenizer, or prompt lookup. */
  drafter: { draftDir: string } | 'prompt-lookup' | Drafter
  backend?: BackendName
  device?: string
  threads?: number
  maxSequences?: number
  metrics?: Registry
  /** Each request's counts when it ends (tests, receipts). */
  onRequestEnd?: (requestId: string, counts: SpeculationCounts) => void
}

export interface Speculation extends TokenSourceWrapper {
  /** 'prompt-lookup' or 'draft:<model id>' (after start for a draft model). */
  readonly drafterName: string
}

/**
 * Why speculation cannot keep this target's tokens exact, or undefined when it can. A verify step
 * runs K + 1 positions where plain decoding runs one; with f32 activations the two differ only in
 * the last bits (as padded batches do), but int8 activations turn those bits into whole
 * quantization steps: on a generated 250m int4 model a 2-position step chose a different token
 * than one-position decoding at a margin of 6e-3 (reproduction/results/speculative.md).
 */
export function inexactTarget (manifest: Pick<ShardManifest, 'quantization'>): string | undefined {
  const q = manifest.quantization
  if (q.kind === 'none' || q.activations === 'f32') return undefined
  return `its ${q.kind} shards compute in int8 activations, where a verify step of several positions can round to a different token than one-position decoding; compile it with --f32-activations to speculate`
}

export function createSpeculation (init: SpeculationInit): Speculation {
  const metrics = createSpeculationMetrics(init.metrics)
  let draftModel: DraftModel | undefined
  let drafter: Drafter
  if (init.drafter === 'prompt-lookup') drafter = createPromptLookupDrafter()
  else if ('draftDir' in init.drafter) {
    draftModel = createDraftModel({
      shardDir: init.drafter.draftDir,
      ...(init.backend === undefined ? {} : { backend: init.backend }),
      ...(init.device === undefined ? {} : { device: init.device }),
      ...(init.threads === undefined ? {} : { threads: init.threads }),
      ...(init.maxSequences === undefined ? {} : { maxSequences: init.maxSequences }),
      ...(init.metrics === undefined ? {} : { metrics: init.metrics }),
    })
    drafter = draftModel
  } else drafter = init.drafter
  let modelId = ''
  return {
    get drafterName () { return drafter.name },
    async start (target) {
      modelId = target.modelId
      const why = inexactTarget(target.manifest)
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
    wrap (ctx) {
      const labels = { model: modelId, drafter: drafter.name }
      const source = createSpeculativeSource({
        ...init,
        seqId: ctx.seqId,
        target: { step: ctx.step, rollback: ctx.rollback },
        drafter,
        sampling: ctx.request.sampling,
        maxTokens: ctx.request.maxTokens,
        maxPositions: ctx.manifest.shape.maxPositions,
        vocabSize: ctx.manifest.shape.vocabSize,
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
        async close () {
          await source.close()
          init.onRequestEnd?.(ctx.request.requestId, source.counts())
        },
      }
    },
  }
}
