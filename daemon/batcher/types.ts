/**
 * The batcher's data: what callers submit, what the planner sees, what an executor runs.
 * Output shapes match the stage engine's step output (daemon/engine StepOutput) so an engine's
 * results pass through unchanged; nothing here imports the engine.
 */
import type { Registry } from 'prom-client'

/**
 * Decodes (one new position per sequence) go before prefills: a decode holds a live stream's next
 * token, a prefill only delays a first token that is already the slow part. Old prefills are still
 * guaranteed a place (see BatchLimits.prefillAgingMs).
 */
export type StepKind = 'prefill' | 'decode'

/** Token ids (the stage holding the embedding) or hidden rows [positions, D] row-major (every other stage). */
export type StepInput = { tokenIds: number[] } | { hidden: Float32Array }

/** One step of one sequence, as a caller submits it. */
export interface StepRequest {
  seqId: string
  kind: StepKind
  input: StepInput
  /** Absolute position of every new row (ragged lengths and positions are fine in one batch). */
  positions: number[]
  /** Last stage: logits for the last K positions of the whole step (default 1). */
  logitsToKeep?: number
  /** Last stage: have the executor pick the next token from the last position (the result is {kind: 'token'}). */
  pick?: TokenPick
  /**
   * Run-ahead (a step with `pick`: a decode step, or a prefill, whose last chunk carries them):
   * the picks of this sequence's next decode steps, so the executor may compute them before they
   * are submitted (daemon/engine/stage-engine.ts).
   */
  ahead?: TokenPick[]
  /**
   * Last stage: a greedy speculative verify (the engine's BatchStepItem.verify: a token and its
   * drafts, every position's logits kept); the result is {kind: 'verdict'}, or the logits where the
   * step ran in chunks (the engine checks a verify whole). `ahead` goes with it.
   */
  verify?: 'greedy'
  /** A hidden-state verify's drafts (a chain's last stage; token input carries them after its first id). */
  drafts?: number[]
  /**
   * A prefill's own queue budget (ms), in place of the batcher's: a request sent to the last node
   * that could take it (GenerateRequest.soleServer) waits until its deadline rather than be refused.
   */
  budgetMs?: number
  /**
   * The most positions the sequence may reach (a prefill's: its prompt and max_tokens, within the
   * context): a hint for the room the engine gives its cache, never a limit.
   */
  reach?: number
}

/** Sampling settings with the random draw already made (the engine's TokenPick, structurally). */
export interface TokenPick {
  temperature: number
  topP: number
  /** Uniform in [0, 1). */
  u: number
}

export type StepResult =
  /** Row-major [count, vocab]: logits of the last `count` positions. */
  | { kind: 'logits', data: Float32Array, count: number, vocab: number }
  /** Row-major [count, hidden]: hidden states of every new position. */
  | { kind: 'hidden', data: Float32Array, count: number, hidden: number }
  /** The token picked from the last position's logits (a step submitted with `pick`). */
  | { kind: 'token', id: number }
  /** A verify's outcome (a step submitted with `verify`): drafts accepted, and the token after them. */
  | { kind: 'verdict', accepted: number, id: number }

/** What the planner sees of a queued step: plain data, no inputs. */
export interface PendingStep {
  readonly id: number
  readonly seqId: string
  readonly kind: StepKind
  /** Positions of this step still to run (a chunked prefill shrinks from the front). */
  readonly tokens: number
  /** When the step joined the queue (ms, the batcher's clock); a remainder keeps its place. */
  readonly enqueuedAt: number
}

/** Part of a pending step chosen for a run: its first `tokens` remaining positions. */
export interface Chunk<T extends PendingStep = PendingStep> {
  step: T
  tokens: number
}

export interface BatchLimits {
  /** Sequences per run. */
  maxBatch: number
  /** Positions per run (not a request's max_tokens), so a long prefill is chunked and cannot stall decodes; at least maxBatch. */
  maxPositions: number
  /** How long the oldest waiter may wait for company before a partial batch runs. */
  maxQueueDelayMs: number
  /** After this long in the queue the oldest prefill is guaranteed a slot in every run. */
  prefillAgingMs: number
}

export interface BatchPlan<T extends PendingStep = PendingStep> {
  /** What to run now, in order (empty: nothing to run yet). */
  run: Array<Chunk<T>>
  /** When run is empty and the queue is not: ms until planning again makes sense. */
  wait?: number
}

/** One sequence's part of a batched run. */
export interface BatchItem {
  seqId: string
  kind: StepKind
  input: StepInput
  positions: number[]
  /** Logits rows wanted from this chunk (≥ 1; rows of a non-final chunk may be discarded). */
  logitsToKeep: number
  /** False for a prefill chunk that more chunks follow. */
  final: boolean
  /** The step's pick, on its final chunk only (earlier chunks' logits are discarded). */
  pick?: TokenPick
  /** As StepRequest.ahead (a decode step, or a prefill's final chunk). */
  ahead?: TokenPick[]
  /** As StepRequest.verify and .drafts, on a step that runs whole only. */
  verify?: 'greedy'
  drafts?: number[]
  /** As StepRequest.reach (every chunk of a step that has it). */
  reach?: number
  /** The caller's signal: an executor may drop an item whose caller has gone. */
  signal: AbortSignal
}

/**
 * The run an executor computed a result in, timed where it ran (a stage engine's worker turn):
 * `rows` sequences' steps of `positions` positions in all took `ms`. Results of one run share its
 * `id` (ids grow run by run).
 */
export interface ExecutorRun { id: number, rows: number, positions: number, ms: number }

/**
 * Per-item outcome, so one bad sequence does not fail its batch-mates.
 * `ranAhead`: the executor had the result already (computed ahead of the step's submission); its
 * run time is not this batch's. `run`: the run that computed it, when the executor timed it: the
 * step-time models learn from those runs (ahead or not) instead of the batch's wall time.
 */
export type BatchItemResult = { output: StepResult, ranAhead?: boolean, run?: ExecutorRun } | { error: Error }

/**
 * What the batcher drives: one session, one run at a time. Results come back in item order.
 * A thrown error fails every item of that batch (and only those).
 */
export interface BatchExecutor {
  run (items: BatchItem[], signal: AbortSignal): Promise<BatchItemResult[]>
}

/** The live load record's batcher part. */
export interface BatcherLoad {
  /** Steps waiting for a run. */
  queueDepth: number
  /** Steps in the run executing now. */
  inFlight: number
  /** What a new prefill would wait before its run starts, ms. */
  expectedWaitMs: number
  /** Decode positions per second over the recent past (time-decayed). */
  decodeTokensPerSecond: number
}

export interface Clock {
  now (): number
}

export interface BatcherInit {
  /** Label on the metrics (one batcher per engine session). */
  name?: string
  limits?: Partial<BatchLimits>
  /**
   * The batcher's own latency budget, ms: a new prefill whose expected queue wait exceeds it is
   * refused with SHOAL_ERR_OVERLOADED. Separate from the network deadline and the stream's
   * deadline, which belong to routing and ingress; the batcher never spends them.
   */
  budgetMs?: number
  /** Hard bound on queued steps (decodes included). */
  maxQueue?: number
  /** Step time before any run was measured. */
  prior?: StepCostModel
}

export interface BatcherComponents {
  executor: BatchExecutor
  metrics?: Registry
  clock?: Clock
  /**
   * Sequences per run allowed right now, below limits.maxBatch (read at every plan). A pipeline
   * stage uses it to keep its requests in as many waves as the chain has stages: batching all of
   * them together would march them through the chain in lockstep and leave every other stage idle.
   */
  batchCap?: () => number
}

/** Step time ≈ fixedMs + perSequenceMs × sequences + perTokenMs × positions. */
export interface StepCostModel {
  fixedMs: number
  perSequenceMs: number
  perTokenMs: number
}

export interface Batcher {
  start (): Promise<void>
  /** Refuses new steps, fails queued ones (SHOAL_ERR_SHUTTING_DOWN), aborts and awaits the running batch. */
  stop (): Promise<void>
  /**
   * Queues one step and resolves with its own result. Rejects with SHOAL_ERR_OVERLOADED (with
   * `retryAfterMs`) at once when it cannot run within the budget, SHOAL_ERR_BAD_REQUEST for a
   * malformed step or a sequence that already has a step queued or running, the signal's reason
   * when aborted.
   */
  submit (step: StepRequest, signal?: AbortSignal): Promise<StepResult>
  /** The sequence will submit no more steps (ended or freed): its company is not waited for. */
  release (seqId: string): void
  load (): BatcherLoad
  /**
   * Estimated time of one run over `sequences` sequences and `tokens` positions (default: one per
   * sequence, a decode run, estimated from decode runs alone once there have been any: by row
   * count, DecodeTimeTable); 0 before any run. Learnt from the runs as the executor timed them
   * (ExecutorRun), else from this batcher's wall time around the runs not computed ahead.
   */
  estimateStepMs (sequences: number, tokens?: number): number
  /**
   * The fastest run of one sequence's one position learnt so far (ms; 0 before any): a bound the
   * engine's decode step cannot beat, which a cold engine's first, slow runs do not move (the
   * warm-up's gate on a model too slow to warm up; daemon/node/warm-up.ts).
   */
  fastestDecodeMs (): number
}
