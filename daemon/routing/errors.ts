/**
 * Typed errors of routing and forwarding. Callers compare `code` (and, in-process, the
 * `phase` / `retryable` of a ForwardError), never message text.
 */
import { ShoalError, WireFormatError, type ShoalErrorCode } from '../errors.ts'
export { ModelNotFoundError, OverloadedError } from '../errors.ts'

/** Codes of /shoal/infer wire violations; they may also travel back in an error frame. */
export type InferWireErrorCode =
  | 'SHOAL_ERR_INFER_UNSUPPORTED_VERSION'
  | 'SHOAL_ERR_INFER_UNKNOWN_KIND'
  | 'SHOAL_ERR_INFER_TOO_LARGE'
  | 'SHOAL_ERR_INFER_TRUNCATED'
  | 'SHOAL_ERR_INFER_MALFORMED'
  | 'SHOAL_ERR_INFER_UNEXPECTED_FRAME'

/** A frame that cannot be decoded or does not fit the conversation. */
export class InferWireError extends WireFormatError<InferWireErrorCode> {
  override name = 'InferWireError'
}


/** Nodes know the model but none may serve it now (not admitted, unreachable, …): HTTP 503. */
export class NoEligibleNodeError extends ShoalError {
  override name = 'NoEligibleNodeError'
  constructor (message: string) {
    super('SHOAL_ERR_NO_ELIGIBLE_NODE', message)
  }
}


/** Stage holders do not form a complete chain for a sharded model. */
export class ChainIncompleteError extends ShoalError {
  override name = 'ChainIncompleteError'
  constructor (message: string) {
    super('SHOAL_ERR_CHAIN_INCOMPLETE', message)
  }
}

/**
 * Where a forwarded request failed: before the `start` event (nothing reached the client, so
 * another replica may take it) or after (tokens were sent; the stream ends with the error).
 */
export type ForwardPhase = 'before-start' | 'after-start'

/** Every error thrown by forwardGenerate is one of these. */
export class ForwardError extends ShoalError {
  override name = 'ForwardError'
  readonly phase: ForwardPhase
  /** True when the request may be sent, unchanged, to another replica. */
  readonly retryable: boolean
  readonly peerId: string | undefined
  constructor (code: ShoalErrorCode, message: string, phase: ForwardPhase, retryable: boolean, peerId?: string, options?: ErrorOptions) {
    super(code, message, options)
    this.phase = phase
    this.retryable = retryable && phase === 'before-start'
    this.peerId = peerId
  }
}

/** The peer could not be reached, or its stream broke before `start`: retry elsewhere. */
export class PeerUnavailableError extends ForwardError {
  override name = 'PeerUnavailableError'
  constructor (message: string, peerId?: string, options?: ErrorOptions) {
    super('SHOAL_ERR_PEER_UNAVAILABLE', message, 'before-start', true, peerId, options)
  }
}

/** The peer's stream broke, went silent or misbehaved after `start`. */
export class PeerLostError extends ForwardError {
  override name = 'PeerLostError'
  constructor (message: string, peerId?: string, options?: ErrorOptions) {
    super('SHOAL_ERR_PEER_LOST', message, 'after-start', false, peerId, options)
  }
}

/** The request's deadline passed (locally or on the peer). */
export class DeadlineExceededError extends ForwardError {
  override name = 'DeadlineExceededError'
  constructor (message: string, phase: ForwardPhase, peerId?: string) {
    super('SHOAL_ERR_DEADLINE', message, phase, false, peerId)
  }
}

/** The request cannot travel at all (its frame exceeds the cap): 413, and no other replica would take it either. */
export class RequestTooLargeError extends ForwardError {
  override name = 'RequestTooLargeError'
  constructor (message: string, peerId?: string) {
    super('SHOAL_ERR_CONTEXT_LENGTH', message, 'before-start', false, peerId)
  }
}

/** The caller aborted (client went away). */
export class ForwardAbortedError extends ForwardError {
  override name = 'ForwardAbortedError'
  constructor (phase: ForwardPhase, peerId?: string, options?: ErrorOptions) {
    super('SHOAL_ERR_ABORTED', 'the request was aborted', phase, false, peerId, options)
  }
}

/**
 * Codes a peer (or the local engine) may report before `start` that say "not here, try another":
 * the node is busy, draining, lost the model since it gossiped, or broke internally. Everything
 * else (bad request, context too long, deadline) would fail the same way anywhere.
 */
export const RETRYABLE_CODES: ReadonlySet<string> = new Set<ShoalErrorCode>([
  'SHOAL_ERR_OVERLOADED',
  'SHOAL_ERR_MODEL_NOT_FOUND',
  'SHOAL_ERR_SHUTTING_DOWN',
  'SHOAL_ERR_NO_ELIGIBLE_NODE',
  'SHOAL_ERR_INTERNAL',
  'SHOAL_ERR_PEER_UNAVAILABLE',
])

/** An error frame received from the peer; keeps the peer's name and code. */
export class RemoteError extends ForwardError {
  /** The peer's own retry estimate when it was overloaded (the ingress's Retry-After). */
  readonly retryAfterMs: number | undefined
  /** The request field the peer named (OpenAI's `param`), carried to the client unchanged. */
  readonly param: string | undefined
  constructor (remote: { name: string, code: string, message: string, retryAfterMs?: number, param?: string }, phase: ForwardPhase, peerId?: string) {
    // Kept as the peer sent it, also a code this build does not list (a newer peer's).
    super(remote.code as ShoalErrorCode, remote.message, phase, RETRYABLE_CODES.has(remote.code), peerId)
    this.name = remote.name
    this.retryAfterMs = remote.retryAfterMs
    this.param = remote.param
  }
}

/** True when `err` failed before `start` in a way another replica may not repeat. */
export function isRetryable (err: unknown): boolean {
  const e = err as { retryable?: unknown, code?: unknown } | null
  if (e == null) return false
  if (typeof e.retryable === 'boolean') return e.retryable
  return typeof e.code === 'string' && RETRYABLE_CODES.has(e.code)
}
