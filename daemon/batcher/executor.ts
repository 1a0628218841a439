/**
 * A generic executor: `createSequentialExecutor` runs a batch's items as separate engine steps
 * (the queue, admission, chunking and metrics apply; no shared runs). The engine's
 * `createBatchedExecutor` (daemon/engine) runs a batch as one `stepBatch` and is what serving uses.
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
