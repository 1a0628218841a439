/** What the benchmarks read from a stage engine's greedy steps (picked in the worker). */
import type { StageBatchResult, StepOutput } from '../../daemon/engine/index.ts'

/** The token a step picked; a step that returned logits or hidden states was asked wrongly. */
export function tokenOf (out: StepOutput): number {
  if (out.kind !== 'token') throw new Error(`expected a token, got ${out.kind}`)
  return out.id
}

/** The token one row of a `stepBatch` picked, or that row's error. */
export function batchTokenOf (r: StageBatchResult): number {
  if ('error' in r) throw r.error
  return tokenOf(r.output)
}
