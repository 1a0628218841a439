/**
 * The batching decision as a pure function: which queued steps run together now, or how long to
 * wait for company. No clocks, no timers, no I/O — the runtime gathers the queue and carries out
 * the plan.
 *
 * Order: decodes first, FIFO by enqueue time; then prefills, FIFO. A batch is a prefix of that
 * order, cut at `maxBatch` sequences or `maxPositions` positions; the step that crosses the token
 * budget is chunked (its first positions run, the remainder keeps its place in line, so a
 * sequence's chunks run in order). One step per sequence per run.
 *
 * A step of several positions is never cut into a one-position chunk, nor cut so that one
 * position remains: onnxruntime computes a one-position step with another attention kernel than a
 * longer one, whose last bits differ (int8 activations turn them into different tokens), while
 * steps of two or more positions give the same bits however a prompt is split. So a sequence's
 * tokens never depend on how busy the node was (limits with maxPositions < 4 excepted).
 *
 * No starvation: once the oldest prefill has waited `prefillAgingMs`, decodes leave it one slot and
 * three positions in every run until it is done (with maxBatch 1, whichever of the two heads is
 * older runs). Decodes still progress in every run, since maxPositions ≥ maxBatch.
 *
 * Run now when the batch is as large as the limits allow, when the oldest waiter has waited
 * `maxQueueDelayMs`, or when no company is expected (`awaiting === 0`); else wait until the oldest
 * waiter's delay is up.
 */
import type { BatchLimits, BatchPlan, Chunk, PendingStep } from './types.ts'

export interface PlanHints {
  /**
   * Sequences expected to submit soon (they just got a result). 0 means nobody is coming, so
   * waiting buys nothing; undefined means unknown (wait up to maxQueueDelayMs).
   */
  awaiting?: number
}

export function planBatch<T extends PendingStep> (queue: readonly T[], limits: BatchLimits, now: number, hints: PlanHints = {}): BatchPlan<T> {
  const decodes: T[] = []
  const prefills: T[] = []
  const seen = new Set<string>()
  let oldest = Infinity
  // Stable: equal times keep queue order.
  for (const step of [...queue].sort((a, b) => a.enqueuedAt - b.enqueuedAt)) {
    if (!(step.tokens > 0) || seen.has(step.seqId)) continue // a later step of a sequence waits for the earlier one
    seen.add(step.seqId)
    oldest = Math.min(oldest, step.enqueuedAt)
    ;(step.kind === 'decode' ? decodes : prefills).push(step)
  }
  if (decodes.length + prefills.length === 0) return { run: [] }

  const { maxBatch, maxPositions } = limits
  const head = prefills[0]
  const aged = head !== undefined && now - head.enqueuedAt >= limits.prefillAgingMs
  let decodeSlots = maxBatch
  if (aged) {
    if (maxBatch > 1) decodeSlots = maxBatch - 1
    else if (decodes[0] === undefined || decodes[0].enqueuedAt > head.enqueuedAt) decodeSlots = 0
  }
  const reserved = aged && decodeSlots < maxBatch

  const run: Array<Chunk<T>> = []
  let used = 0
  let cut = false
  /** Takes a FIFO prefix of `list`; true when the whole list fit. */
  const take = (list: T[], slots: number, tokenCap: number): boolean => {
    for (const step of list) {
      if (run.length >= slots || used >= tokenCap) return false
      const n = chunkOf(step.tokens, tokenCap - used, maxPositions)
      if (n === 0) { cut = true; return false }
      run.push({ step, tokens: n })
      used += n
      if (n < step.tokens) { cut = true; return false }
    }
    return true
  }
  const allDecodes = take(decodes, decodeSlots, reserved ? Math.max(maxPositions - AGED_RESERVE, decodeSlots === 0 ? 0 : 1) : maxPositions)
  // Past waiting decodes only the aged head prefill runs, in the room reserved for it.
  if (allDecodes) take(prefills, maxBatch, maxPositions)
  else if (reserved) take([head], maxBatch, maxPositions)

  // As large as the limits allow: more company could not join this run anyway.
  const full = cut || run.length >= maxBatch || used >= maxPositions || run.length < decodes.length + prefills.length
  const age = Math.max(0, now - oldest)
  if (full || age >= limits.maxQueueDelayMs || hints.awaiting === 0) return { run }
  return { run: [], wait: limits.maxQueueDelayMs - age }
}

/** Positions left to an aged prefill in every run: enough for a chunk that leaves no single position. */
const AGED_RESERVE = 3

/**
 * How many of a step's `tokens` positions run in `room`: all when they fit, else a chunk of at least
 * two that does not leave exactly one behind; 0 when no such chunk fits (the step waits a run).
 * With maxPositions < 4 an aged prefill and a decode could not both progress in every run with such
 * chunks, so one-position chunks are allowed there.
 */
export function chunkOf (tokens: number, room: number, maxPositions: number): number {
  if (tokens <= room) return tokens
  if (maxPositions < 4) return room
  const n = tokens - room === 1 ? room - 1 : room
  return n >= 2 ? n : 0
}
