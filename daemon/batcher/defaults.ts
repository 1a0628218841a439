/**
 * Defaults and limit checking. maxBatch and maxQueueDelayMs were checked by measurement
 * (reproduction/results/batching.md; `node reproduction/bench-batching.ts --modes engine,batched
 * --max-batch 4,8,16 --delay 0,2,5 --streams 1,8,16`): on int4 60m/250m, in CPU time, a decode
 * run of 4 sequences costs 1.35–1.7× a run of one, 8 cost 2.5–2.9×, 16 cost 4.3–5.6×: per-token
 * cost flattens past 8, so 8 — the local service's default sequence bound — gets most of the
 * gain with one run per round. The other numbers are first guesses from docs/engine-notes.md.
 */
import type { BatchLimits, StepCostModel } from './types.ts'

export const DEFAULTS = Object.freeze({
  /** Batching is nearly free up to 4 and still gains at 8 (1766 tok/s at batch 8 for the small model). */
  maxBatch: 8,
  /** One 256-position prefill chunk costs a few decode steps, so streams stall at most that long. */
  maxPositions: 256,
  /**
   * Well under one decode step (1.4–7 ms). Must be > 0: in steady state every sequence resubmits
   * within the same macrotask as its batch-mates, and a 0 delay would run the first one alone.
   */
  maxQueueDelayMs: 2,
  /** An old prefill gets a slot in every run after this long behind decodes. */
  prefillAgingMs: 100,
  /** Expected queue wait above which a new prefill is refused (routing then tries another node). */
  budgetMs: 1000,
  /** Hard bound on queued steps. */
  maxQueue: 1024,
  /** Before measurements: roughly the small int4 model on 2 cores. */
  prior: Object.freeze({ fixedMs: 1.5, perSequenceMs: 0.4, perTokenMs: 0.1 }) as Readonly<StepCostModel>,
})

export function resolveLimits (partial: Partial<BatchLimits> = {}): BatchLimits {
  const limits: BatchLimits = {
    maxBatch: partial.maxBatch ?? DEFAULTS.maxBatch,
    maxPositions: partial.maxPositions ?? Math.max(DEFAULTS.maxPositions, partial.maxBatch ?? 0),
    maxQueueDelayMs: partial.maxQueueDelayMs ?? DEFAULTS.maxQueueDelayMs,
    prefillAgingMs: partial.prefillAgingMs ?? Math.max(DEFAULTS.prefillAgingMs, partial.maxQueueDelayMs ?? 0),
  }
  checkLimits(limits)
  return limits
}

/** Throws RangeError naming the bad key. */
export function checkLimits (l: BatchLimits): void {
  if (!Number.isSafeInteger(l.maxBatch) || l.maxBatch < 1) throw new RangeError(`limits.maxBatch must be a positive integer, got ${l.maxBatch}`)
  if (!Number.isSafeInteger(l.maxPositions) || l.maxPositions < l.maxBatch) throw new RangeError(`limits.maxPositions must be an integer ≥ maxBatch (${l.maxBatch}), got ${l.maxPositions}`)
  if (!(l.maxQueueDelayMs >= 0) || !Number.isFinite(l.maxQueueDelayMs)) throw new RangeError(`limits.maxQueueDelayMs must be a finite number ≥ 0, got ${l.maxQueueDelayMs}`)
  if (!(l.prefillAgingMs >= l.maxQueueDelayMs) || !Number.isFinite(l.prefillAgingMs)) throw new RangeError(`limits.prefillAgingMs must be finite and ≥ maxQueueDelayMs, got ${l.prefillAgingMs}`)
}
