/**
 * The daemon's error catalogue. Every error has a stable `code` (SHOAL_ERR_*) and sets `name`;
 * code crossing a worker or wire boundary compares `code`, never `instanceof` or message text.
 * HTTP status mapping lives in exactly one place: `httpStatusOf` below.
 */
export class ShoalError extends Error {
  override name = 'ShoalError'
  readonly code: string
  constructor (code: string, message: string, options?: ErrorOptions) {
    super(message, options)
    this.code = code
  }
}

// Errors more than one module throws: each lives here once (compared by `code` everywhere).

/** 404: the model is not served here (`servedHere` names what is), or by no node of the mesh. */
export class ModelNotFoundError extends ShoalError {
  override name = 'ModelNotFoundError'
  constructor (model: string, servedHere?: string[]) {
    super('SHOAL_ERR_MODEL_NOT_FOUND', servedHere === undefined
      ? `model "${model}" is not served by any node in the mesh`
      : `model "${model}" is not served here (serving: ${servedHere.join(', ') || 'none'})`)
  }
}

/** 429: too busy to take this now; `retryAfterMs`, when known, becomes Retry-After. */
export class OverloadedError extends ShoalError {
  override name = 'OverloadedError'
  readonly retryAfterMs: number | undefined
  constructor (message: string, retryAfterMs?: number) {
    super('SHOAL_ERR_OVERLOADED', message)
    this.retryAfterMs = retryAfterMs
  }
}

/** 499: the caller went away (a request, or one step of it, was cancelled). */
export class AbortedError extends ShoalError {
  override name = 'AbortedError'
  constructor (message = 'request was cancelled') { super('SHOAL_ERR_ABORTED', message) }
}

/** The plain shape an error takes across worker_threads and the wire. */
export interface SerializedError {
  name: string
  code: string
  message: string
  /** An overloaded component's own estimate of when to retry (becomes Retry-After). */
  retryAfterMs?: number
  /** The request field at fault (OpenAI's `param`), when the error names one. */
  param?: string
}

export function serializeError (err: unknown): SerializedError {
  if (err instanceof Error) {
    const code = typeof (err as { code?: unknown }).code === 'string' ? (err as unknown as { code: string }).code : 'SHOAL_ERR_INTERNAL'
    const retryAfterMs = (err as { retryAfterMs?: unknown }).retryAfterMs
    const param = (err as { param?: unknown }).param
    const out: SerializedError = { name: err.name, code, message: err.message }
    if (typeof retryAfterMs === 'number' && Number.isFinite(retryAfterMs)) out.retryAfterMs = retryAfterMs
    if (typeof param === 'string') out.param = param
    return out
  }
  return { name: 'Error', code: 'SHOAL_ERR_INTERNAL', message: String(err) }
}

export function deserializeError (e: SerializedError): ShoalError {
  const err = new ShoalError(e.code, e.message) as ShoalError & { retryAfterMs?: number, param?: string }
  err.name = e.name
  if (e.retryAfterMs !== undefined) err.retryAfterMs = e.retryAfterMs
  if (e.param !== undefined) err.param = e.param
  return err
}

export function errorCodeOf (err: unknown): string | undefined {
  const code = (err as { code?: unknown } | null)?.code
  return typeof code === 'string' ? code : undefined
}

/** code → [HTTP status, OpenAI error type]. Unknown codes are 500 server_error. */
const HTTP: Record<string, [number, string]> = {
  SHOAL_ERR_BAD_REQUEST: [400, 'invalid_request_error'],
  SHOAL_ERR_UNSUPPORTED_PARAMETER: [400, 'invalid_request_error'],
  SHOAL_ERR_INVALID_API_KEY: [401, 'invalid_request_error'],
  SHOAL_ERR_MODEL_NOT_FOUND: [404, 'invalid_request_error'],
  SHOAL_ERR_CONTEXT_LENGTH: [413, 'invalid_request_error'],
  SHOAL_ERR_BODY_TOO_LARGE: [413, 'invalid_request_error'],
  SHOAL_ERR_URI_TOO_LONG: [414, 'invalid_request_error'],
  SHOAL_ERR_HEADERS_TOO_LARGE: [431, 'invalid_request_error'],
  SHOAL_ERR_CLIENT_TIMEOUT: [408, 'invalid_request_error'],
  SHOAL_ERR_OVERLOADED: [429, 'rate_limit_error'],
  SHOAL_ERR_NO_ELIGIBLE_NODE: [503, 'server_error'],
  SHOAL_ERR_SHUTTING_DOWN: [503, 'server_error'],
  SHOAL_ERR_LEDGER_BUSY: [503, 'server_error'],
  SHOAL_ERR_LEDGER_CLOSED: [503, 'server_error'],
  SHOAL_ERR_PEER_UNAVAILABLE: [503, 'server_error'],
  SHOAL_ERR_CHAIN_INCOMPLETE: [503, 'server_error'],
  SHOAL_ERR_EXPERTS_UNPLACEABLE: [503, 'server_error'],
  SHOAL_ERR_ROLE_REFUSED: [503, 'server_error'],
  SHOAL_ERR_PEER_LOST: [502, 'server_error'],
  SHOAL_ERR_DEADLINE: [504, 'server_error'],
  SHOAL_ERR_ABORTED: [499, 'server_error'],
  SHOAL_ERR_NOT_FOUND: [404, 'invalid_request_error'],
  SHOAL_ERR_BACKEND_UNAVAILABLE: [503, 'server_error'],
  SHOAL_ERR_SHARD_INVALID: [500, 'server_error'],
  SHOAL_ERR_ENGINE: [500, 'server_error'],
}

export function httpStatusOf (err: unknown): { status: number, type: string } {
  const entry = HTTP[errorCodeOf(err) ?? '']
  return entry === undefined ? { status: 500, type: 'server_error' } : { status: entry[0], type: entry[1] }
}
