/**
 * Sequence admission as a pure decision: a request that finds every sequence slot busy waits for
 * one when the expected wait is within the budget (as llama-server, vLLM and Triton queue), and
 * only beyond that is refused with a retry estimate. Refusing a burst that would be served in a
 * fraction of the budget only makes clients retry later than they would have been answered.
 *
 * The expected wait replays the slots: each running sequence frees its slot after its remaining
 * tokens (an upper bound: max_tokens, or the context's end), each waiter ahead takes the earliest
 * free slot and holds it for its own tokens, and the new request gets the next one. All sequences
 * advance one token per batched step, so time is tokens × the step time at a full batch.
 *
 * A refused request is told when to come back (`slotRefusalHint`) as if the requests refused
 * before it, and not yet back, were waiting ahead of it: a burst refused at once is then told
 * the same moment while free slots await them all, and later turns only beyond that.
 */
import { PROMISE_HORIZON_MS } from '../batcher/index.ts'

export interface SlotState {
  /** Sequences the engine runs at once. */
  slots: number
  /** Tokens each running sequence may still generate (≤ slots entries). */
  running: readonly number[]
  /** Tokens each waiting request may generate, in queue order. */
  waiting: readonly number[]
  /** ms of one decode step with every slot busy; 0 when not yet measured. */
  stepMs: number
}

export interface AdmissionPolicy {
  /** Longest expected wait for a slot before a request is refused. */
  budgetMs: number
  /** Bound on waiting requests, whatever the estimate. */
  maxWaiting: number
}

export type AdmissionDecision =
  | { kind: 'run' }
  | { kind: 'wait', expectedWaitMs: number }
  /** `cause`: every waiting place taken (maxWaiting), or a wait past the budget. */
  | { kind: 'refuse', cause: 'waiting' | 'budget', expectedWaitMs: number, retryAfterMs: number, reason: string }

/** Expected ms until a newly arriving request gets a slot (0 when one is free and nobody waits). */
export function expectedSlotWaitMs (s: SlotState): number {
  const step = Math.max(0, s.stepMs)
  const free: number[] = s.running.slice(0, s.slots).map(t => Math.max(0, t) * step)
  while (free.length < s.slots) free.push(0)
  if (free.length === 0) return Infinity
  free.sort((a, b) => a - b)
  for (const tokens of s.waiting) {
    // The earliest free slot goes to this waiter, busy again after its own tokens.
    const at = free.shift() as number
    const until = at + Math.max(0, tokens) * step
    let i = 0
    while (i < free.length && (free[i] as number) <= until) i++
    free.splice(i, 0, until)
  }
  return free[0] as number
}

export function decideAdmission (s: SlotState, policy: AdmissionPolicy): AdmissionDecision {
  if (s.running.length < s.slots && s.waiting.length === 0) return { kind: 'run' }
  const wait = expectedSlotWaitMs(s)
  if (s.waiting.length >= policy.maxWaiting) {
    return { kind: 'refuse', cause: 'waiting', expectedWaitMs: wait, retryAfterMs: Math.max(1, Math.ceil(wait)), reason: `all ${s.slots} sequences are busy and ${s.waiting.length} requests are already waiting` }
  }
  if (wait > policy.budgetMs) {
    return {
      kind: 'refuse',
      cause: 'budget',
      expectedWaitMs: wait,
      retryAfterMs: Math.max(1, Math.ceil(wait - policy.budgetMs)),
      reason: `all ${s.slots} sequences are busy; the expected wait of ${Math.round(wait)} ms for one exceeds the budget of ${policy.budgetMs} ms`,
    }
  }
  return { kind: 'wait', expectedWaitMs: wait }
}

/** A refused request's promised turn: its tokens, and when it was told to come back (clock ms). */
export interface SlotPromise { tokens: number, returnAt: number }

/**
 * `refusal.retryAfterMs` reshaped for a request of `tokens` refused at `now`: the wait it would
 * have with the promises still out (those whose return time is ahead) queued before it, less the
 * budget when the budget refused it (back then, its wait fits), bounded by the batcher's horizon
 * for its own promises (a minute past the wait: the openai SDKs ignore longer hints). Returns the
 * hint and the promise to keep for the next refusal.
 */
export function slotRefusalHint (s: SlotState, policy: AdmissionPolicy, refusal: Extract<AdmissionDecision, { kind: 'refuse' }>, promised: readonly SlotPromise[], now: number, tokens: number): { retryAfterMs: number, promise: SlotPromise } {
  const out = promised.filter(p => p.returnAt > now).map(p => p.tokens)
  const wait = Math.min(expectedSlotWaitMs({ ...s, waiting: [...s.waiting, ...out] }), refusal.expectedWaitMs + PROMISE_HORIZON_MS)
  const retryAfterMs = Math.max(refusal.retryAfterMs, 1, Math.ceil(refusal.cause === 'budget' ? wait - policy.budgetMs : wait))
  return { retryAfterMs, promise: { tokens: Math.max(0, tokens), returnAt: now + retryAfterMs } }
}

/**
 * A request's own wait budget: the last node that could take it (routing's `soleServer`) waits
 * until its deadline rather than refuse it for the service's budget — the refusal exists so that
 * routing can place the request elsewhere, and there is nowhere else. Undefined: the service's.
 */
export function ownWaitBudget (request: { soleServer?: true, deadline: number }, budgetMs: number, nowMs: number): number | undefined {
  return request.soleServer === true ? Math.max(budgetMs, request.deadline - nowMs) : undefined
}
