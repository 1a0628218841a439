/**
 * Executors the batcher can drive today. Until the engine grows a batched step (several
 * sequences in one session.run), `createSequentialExecutor` runs a batch's items as separate
 * engine steps: the queue, admission, chunking and metrics already apply; the speed-up comes with
 * the batched step.
 */
import type { BatchExecutor, BatchItemResult, StepInput, StepResult } from './types.ts'

/** A stage engine's step, structurally (daemon/engine's StageEngine has this shape). */
export interface StepEngine {
  step (seqId: string, input: StepInput, positions: number[], options?: { logitsToKeep?: number }, signal?: AbortSignal): Promise<StepResult>
}

export function createSequentialExecutor (engine: StepEngine): BatchExecutor {
  return {
    async run (items, signal) {
      return await Promise.all(items.map(async (item): Promise<BatchItemResult> => {
        try {
          const output = await engine.step(item.seqId, item.input, item.positions, { logitsToKeep: item.logitsToKeep }, AbortSignal.any([signal, item.signal]))
          return { output }
        } catch (err) {
          return { error: err instanceof Error ? err : new Error(String(err)) }
        }
      }))
    },
  }
}
