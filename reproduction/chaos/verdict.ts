/**
 * What a request under chaos may end as, decided from plain data (no sockets), and the per-fault
 * tally. A request is fine when it is a whole, correct, receipted completion or a clean error: an
 * OpenAI-shaped error with a status a client can act on (429, 502, 503, 504) and a stable
 * SHOAL_ERR_* code — or, once tokens have flowed, the same error as an SSE error event. It fails
 * when it outlives the hang bound, ends empty, carries other tokens than the reference, names no
 * receipt, or fails any other way (a reset from a live ingress, a 500, an error without a code).
 * A connection refused or reset by an ingress the suite itself killed is counted apart: nothing
 * was acknowledged, and a client can only see it as a dead server.
 */

export type OutcomeKind =
  | 'ok' | 'clean-error' | 'ingress-down'
  | 'wrong' | 'no-receipt' | 'empty' | 'hang' | 'unclean-error'

/** Kinds that fail the suite. */
export const FAILURES: readonly OutcomeKind[] = ['wrong', 'no-receipt', 'empty', 'hang', 'unclean-error']

export const RETRYABLE_STATUSES: readonly number[] = [429, 502, 503, 504]

export interface Outcome {
  kind: OutcomeKind
  /** The fault phase running when the request was sent. */
  phase: string
  ingress: string
  model: string
  stream: boolean
  ms: number
  receiptId?: string
  status?: number
  code?: string
  detail?: string
}

export interface FailureFacts {
  /** The suite's own bound fired (the request was still open). */
  timedOut: boolean
  /** No HTTP answer at all (refused, reset, closed). */
  connection: boolean
  /** The ingress it was sent to is down because the suite took it down. */
  ingressDown: boolean
  /** HTTP status; undefined for an error event inside a 200 stream. */
  status?: number
  code?: string | null
  /** OpenAI's error type (server_error, rate_limit_error, …). */
  type?: string | null
  /** Whether the body was OpenAI's error shape at all. */
  shaped: boolean
}

export function classifyFailure (f: FailureFacts): OutcomeKind {
  if (f.timedOut) return 'hang'
  if (f.connection) return f.ingressDown ? 'ingress-down' : 'unclean-error'
  const coded = f.shaped && typeof f.code === 'string' && f.code.startsWith('SHOAL_ERR_') && typeof f.type === 'string' && f.type !== ''
  if (!coded) return 'unclean-error'
  // Mid-stream: the status was the stream's 200; the error event itself is the clean part.
  if (f.status === undefined) return 'clean-error'
  return RETRYABLE_STATUSES.includes(f.status) ? 'clean-error' : 'unclean-error'
}

export interface SuccessFacts {
  finishReason: string | null | undefined
  tokenIds: number[]
  expected: number[] | undefined
  receiptId: string | null | undefined
}

export function classifySuccess (s: SuccessFacts): OutcomeKind {
  if (s.finishReason == null) return 'empty'
  if (s.expected === undefined || s.tokenIds.length !== s.expected.length || s.tokenIds.some((t, i) => t !== s.expected![i])) return 'wrong'
  if (typeof s.receiptId !== 'string' || s.receiptId === '') return 'no-receipt'
  return 'ok'
}

export interface PhaseTally {
  phase: string
  sent: number
  ok: number
  clean: number
  ingressDown: number
  failures: number
  hangs: number
  wrong: number
  /** Clean errors by "status code" (status "stream" for an error event mid-stream). */
  errors: Record<string, number>
  /** Failures by kind with a first example. */
  failed: Record<string, { count: number, example: string }>
  maxMs: number
}

export function tally (outcomes: Outcome[]): PhaseTally[] {
  const byPhase = new Map<string, PhaseTally>()
  for (const o of outcomes) {
    let t = byPhase.get(o.phase)
    if (t === undefined) {
      t = { phase: o.phase, sent: 0, ok: 0, clean: 0, ingressDown: 0, failures: 0, hangs: 0, wrong: 0, errors: {}, failed: {}, maxMs: 0 }
      byPhase.set(o.phase, t)
    }
    t.sent++
    t.maxMs = Math.max(t.maxMs, o.ms)
    if (o.kind === 'ok') t.ok++
    else if (o.kind === 'clean-error') {
      t.clean++
      const key = `${o.status ?? 'stream'} ${o.code ?? ''}`.trim()
      t.errors[key] = (t.errors[key] ?? 0) + 1
    } else if (o.kind === 'ingress-down') t.ingressDown++
    else {
      t.failures++
      if (o.kind === 'hang') t.hangs++
      if (o.kind === 'wrong') t.wrong++
      const f = t.failed[o.kind] ??= { count: 0, example: `${o.ingress} ${o.model}${o.stream ? ' stream' : ''}: ${o.status ?? ''} ${o.code ?? ''} ${o.detail ?? ''}`.replace(/\s+/g, ' ').trim() }
      f.count++
    }
  }
  return [...byPhase.values()]
}
