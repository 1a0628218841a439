/**
 * When a refused prompt is told to come back (retry-after-ms, which the openai SDKs wait before
 * retrying), as a pure function: after the work queued now *and* after the prompts refused before
 * it, each promised its own turn. A burst is refused together; told the earliest moment each would
 * fit the budget, or even when the queue now will be done, its prompts return together and refuse
 * each other again, and the SDK's two retries run out (a lone 250m node lost 3 of 8 prompts of a
 * burst that way: docs/engine-notes.md, wave 11). Told their turns, they return one after another.
 *
 * `tail` is the clock time at which the work promised so far ends; a refusal extends it by the
 * refused prompt's own expected run time. Once the queue's real wait reaches past it (the promised
 * prompts came back and queued, or never did), the wait counts alone. Bounded: under a sustained
 * flood the promises would outrun the clock, so none is made more than PROMISE_HORIZON_MS past
 * the queue's own wait (the openai SDKs ignore a longer retry-after-ms anyway).
 */
export interface Refusal {
  /** ms after which this prompt is likely to be taken. */
  retryAfterMs: number
  /** The new end of the promised work. */
  tail: number
}

/** How far past the queue's own wait a refused prompt may be promised a turn. */
export const PROMISE_HORIZON_MS = 60_000

export function refusalTurn (tail: number, now: number, waitMs: number, ownMs: number): Refusal {
  const queued = now + Math.max(0, waitMs)
  const at = Math.min(Math.max(queued, tail), queued + PROMISE_HORIZON_MS)
  return { retryAfterMs: Math.max(1, Math.ceil(at - now)), tail: at + Math.max(0, ownMs) }
}
