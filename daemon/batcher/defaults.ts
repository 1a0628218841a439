/**
 * Defaults and limit checking. The numbers are first guesses from the shared engine notes
 * (2-core laptop, int4 57M–246M models), to be replaced by measured ones from reproduction/.
 */
import type { BatchLimits, StepCostModel } from './types.ts'

export const DEFAULTS = Object.freeze({
  /** Batching is nearly free up to 4 and still gains at 8 (1766 tok/s at batch 8 for the small model). */
  maxBatch: 8,
  /** One 256-position prefill chunk costs a few decode steps, so streams stall at most that long. */
  maxTokens: 256,
  /** Well under one decode step (1.4–7 ms): waiting for company never costs a whole step. */
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
    maxTokens: partial.maxTokens ?? Math.max(DEFAULTS.maxTokens, partial.maxBatch ?? 0),
    maxQueueDelayMs: partial.maxQueueDelayMs ?? DEFAULTS.maxQueueDelayMs,
    prefillAgingMs: partial.prefillAgingMs ?? Math.max(DEFAULTS.prefillAgingMs, partial.maxQueueDelayMs ?? 0),
  }
  checkLimits(limits)
  return limits
}

/** Throws RangeError naming the bad key. */
export function checkLimits (l: BatchLimits): void {
  if (!Number.isSafeInteger(l.maxBatch) || l.maxBatch < 1) throw new RangeError(`limits.maxBatch must be a positive integer, got ${l.maxBatch}`)
  if (!Number.isSafeInteger(l.maxTokens) || l.maxTokens < l.maxBatch) throw new RangeError(`limits.maxTokens must be an integer ≥ maxBatch (${l.maxBatch}), got ${l.maxTokens}`)
  if (!(l.maxQueueDelayMs >= 0) || !Number.isFinite(l.maxQueueDelayMs)) throw new RangeError(`limits.maxQueueDelayMs must be a finite number ≥ 0, got ${l.maxQueueDelayMs}`)
  if (!(l.prefillAgingMs >= l.maxQueueDelayMs) || !Number.isFinite(l.prefillAgingMs)) throw new RangeError(`limits.prefillAgingMs must be finite and ≥ maxQueueDelayMs, got ${l.prefillAgingMs}`)
}
