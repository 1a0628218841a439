/**
 * The micro-batcher's executor over a stage engine: each batch the batcher plans becomes one
 * `stepBatch` call, so its sequences share session runs inside the worker.
 */
import type { BatchExecutor, BatchItemResult } from '../batcher/index.ts'
import type { BatchingStageEngine } from './stage-engine.ts'

export function createBatchedExecutor (engine: Pick<BatchingStageEngine, 'stepBatch'>): BatchExecutor {
  return {
    async run (items, signal): Promise<BatchItemResult[]> {
      return await engine.stepBatch(items.map(item => ({
        seqId: item.seqId,
        input: item.input,
        positions: item.positions,
        logitsToKeep: item.logitsToKeep,
        ...(item.pick === undefined ? {} : { pick: item.pick }),
        ...(item.ahead === undefined ? {} : { ahead: item.ahead }),
        ...(item.verify === undefined ? {} : { verify: item.verify }),
        ...(item.drafts === undefined ? {} : { drafts: item.drafts }),
        ...(item.reach === undefined ? {} : { reach: item.reach }),
        signal: item.signal,
      })), signal)
    },
  }
}
