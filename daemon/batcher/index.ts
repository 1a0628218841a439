/**
 * The micro-batcher: a deliberate batching layer in front of each engine session. Steps from all
 * sequences that wait for one session (local requests, forwarded ones, pipeline stage steps) are
 * grouped into one run, bounded by `maxBatch` sequences, `maxPositions` positions (long prefills are
 * chunked, so they cannot stall decodes) and `maxQueueDelayMs` (how long the first waiter waits
 * for company). Sequences join and leave between runs (continuous batching).
 *
 * Its own latency budget (`budgetMs`) decides admission: a new prefill that would wait longer is
 * refused at once with SHOAL_ERR_OVERLOADED (429) and `retryAfterMs`, instead of joining a queue
 * it cannot leave in time. The network's and the stream's deadlines are not the batcher's to
 * spend; they arrive only as the caller's AbortSignal.
 *
 * The batching decision is the pure `planBatch`; the runtime (`createBatcher`) carries it out
 * against a `BatchExecutor`, which the engine implements.
 */
export { createBatcher } from './runtime.ts'
export { PROMISE_HORIZON_MS } from './refusal.ts'
export { planBatch } from './policy.ts'
export type { PlanHints } from './policy.ts'
export { DEFAULTS } from './defaults.ts'
export { createDecodeTimeTable, createStepTimeEstimator, createRateMeter } from './estimator.ts'
export type { DecodeTimeTable, StepTimeEstimator, EstimatorOptions, RateMeter } from './estimator.ts'
export { createSequentialExecutor } from './executor.ts'
export type { StepEngine } from './executor.ts'
export type {
  Batcher, BatcherInit, BatcherComponents, BatcherLoad, BatchExecutor, BatchItem, BatchItemResult, ExecutorRun,
  BatchLimits, BatchPlan, Chunk, Clock, PendingStep, StepCostModel, StepInput, StepKind, StepRequest, StepResult,
} from './types.ts'
