/**
 * The daemon's error catalogue. Every error has a stable `code` (SHOAL_ERR_*) and sets `name`;
 * code crossing a worker or wire boundary compares `code`, never `instanceof` or message text.
 * HTTP status mapping lives in exactly one place: `httpStatusOf` below.
 */

/**
 * Every code this build throws, in one list: `ShoalError` takes only these, and the HTTP table
 * below must name a status for each (a new code without one does not compile). Modules type their
 * own codes as subsets (`Extract<ShoalErrorCode, `SHOAL_ERR_STAGE_${string}`>` and the like).
 */
export const SHOAL_ERROR_CODES = [
  // requests (ingress, engine, text)
  'SHOAL_ERR_BAD_REQUEST', 'SHOAL_ERR_UNSUPPORTED_PARAMETER', 'SHOAL_ERR_INVALID_API_KEY',
  'SHOAL_ERR_MODEL_NOT_FOUND', 'SHOAL_ERR_NOT_FOUND', 'SHOAL_ERR_CONTEXT_LENGTH',
  'SHOAL_ERR_BODY_TOO_LARGE', 'SHOAL_ERR_URI_TOO_LONG', 'SHOAL_ERR_HEADERS_TOO_LARGE',
  'SHOAL_ERR_CLIENT_TIMEOUT', 'SHOAL_ERR_OVERLOADED', 'SHOAL_ERR_DEADLINE', 'SHOAL_ERR_ABORTED',
  'SHOAL_ERR_SHUTTING_DOWN', 'SHOAL_ERR_INTERNAL',
  // engine and shards
  'SHOAL_ERR_ENGINE', 'SHOAL_ERR_BACKEND_UNAVAILABLE', 'SHOAL_ERR_SHARD_INVALID',
  'SHOAL_ERR_SHARD_INTEGRITY', 'SHOAL_ERR_UNSUPPORTED_ARCHITECTURE', 'SHOAL_ERR_CHECKPOINT',
  'SHOAL_ERR_LAYER_SPLIT', 'SHOAL_ERR_MANIFEST',
  // node configuration and roles
  'SHOAL_ERR_CONFIG', 'SHOAL_ERR_ROLE_REFUSED',
  // routing and forwarding (/shoal/infer)
  'SHOAL_ERR_NO_ELIGIBLE_NODE', 'SHOAL_ERR_CHAIN_INCOMPLETE', 'SHOAL_ERR_PEER_UNAVAILABLE',
  'SHOAL_ERR_PEER_LOST',
  'SHOAL_ERR_INFER_UNSUPPORTED_VERSION', 'SHOAL_ERR_INFER_UNKNOWN_KIND', 'SHOAL_ERR_INFER_TOO_LARGE',
  'SHOAL_ERR_INFER_TRUNCATED', 'SHOAL_ERR_INFER_MALFORMED', 'SHOAL_ERR_INFER_UNEXPECTED_FRAME',
  // pipeline chains (/shoal/stage)
  'SHOAL_ERR_STAGE_CONFIG',
  'SHOAL_ERR_STAGE_UNSUPPORTED_VERSION', 'SHOAL_ERR_STAGE_UNKNOWN_KIND', 'SHOAL_ERR_STAGE_TOO_LARGE',
  'SHOAL_ERR_STAGE_TRUNCATED', 'SHOAL_ERR_STAGE_MALFORMED', 'SHOAL_ERR_STAGE_UNKNOWN_REQUEST',
  'SHOAL_ERR_STAGE_MISMATCH', 'SHOAL_ERR_STAGE_PREFIX_GONE',
  // expert holders (/shoal/experts)
  'SHOAL_ERR_EXPERTS_UNSUPPORTED_VERSION', 'SHOAL_ERR_EXPERTS_UNKNOWN_KIND',
  'SHOAL_ERR_EXPERTS_TOO_LARGE', 'SHOAL_ERR_EXPERTS_TRUNCATED', 'SHOAL_ERR_EXPERTS_MALFORMED',
  'SHOAL_ERR_EXPERTS_NOT_HELD', 'SHOAL_ERR_EXPERTS_UNPLACEABLE',
  // KV mobility (/shoal/kv): never reach a client (a failed pull means recomputation)
  'SHOAL_ERR_KV_UNSUPPORTED_VERSION', 'SHOAL_ERR_KV_UNKNOWN_KIND', 'SHOAL_ERR_KV_TOO_LARGE',
  'SHOAL_ERR_KV_TRUNCATED', 'SHOAL_ERR_KV_MALFORMED', 'SHOAL_ERR_KV_CHECKSUM',
  'SHOAL_ERR_KV_UNEXPECTED_FRAME', 'SHOAL_ERR_KV_MISMATCH', 'SHOAL_ERR_KV_TIMEOUT',
  'SHOAL_ERR_KV_NOT_HELD', 'SHOAL_ERR_KV_WRONG_MODEL', 'SHOAL_ERR_KV_REFUSED',
  // mesh
  'SHOAL_ERR_MESH_NOT_ADMITTED', 'SHOAL_ERR_MESH_NOT_RUNNING', 'SHOAL_ERR_MESH_CONFIG',
  'SHOAL_ERR_MESH_MALFORMED', 'SHOAL_ERR_MESH_TOO_LARGE', 'SHOAL_ERR_MESH_UNSUPPORTED_VERSION',
  'SHOAL_ERR_MESH_UNEXPECTED_FRAME', 'SHOAL_ERR_MESH_RATE_LIMITED', 'SHOAL_ERR_MESH_REFUSED',
  'SHOAL_ERR_MESH_INTERNAL',
  // witness (/shoal/heads)
  'SHOAL_ERR_WITNESS_MALFORMED', 'SHOAL_ERR_WITNESS_UNSUPPORTED_VERSION',
  // receipt ledger
  'SHOAL_ERR_LEDGER_BUSY', 'SHOAL_ERR_LEDGER_CLOSED', 'SHOAL_ERR_LEDGER_INVALID',
  'SHOAL_ERR_LEDGER_SIGNER', 'SHOAL_ERR_LEDGER_CORRUPT',
  // certificates (certs/: one per refusal reason, plus file problems) and the operator CA
  'SHOAL_ERR_CERT_MALFORMED', 'SHOAL_ERR_CERT_UNKNOWN_FORMAT_VERSION', 'SHOAL_ERR_CERT_WRONG_CA',
  'SHOAL_ERR_CERT_BAD_SIGNATURE', 'SHOAL_ERR_CERT_EXPIRED', 'SHOAL_ERR_CERT_NOT_YET_VALID',
  'SHOAL_ERR_CERT_REVOKED', 'SHOAL_ERR_CERT_PEER_ID_MISMATCH', 'SHOAL_ERR_CERT_FILE',
  'SHOAL_ERR_CA_EXISTS', 'SHOAL_ERR_CA_NOT_FOUND', 'SHOAL_ERR_CA_UNKNOWN_NODE',
  'SHOAL_ERR_CA_NAME_TAKEN', 'SHOAL_ERR_CA_OUT_EXISTS', 'SHOAL_ERR_CA_BAD_OPTION', 'SHOAL_ERR_CA_BUSY',
] as const

export type ShoalErrorCode = typeof SHOAL_ERROR_CODES[number]

const KNOWN_CODES: ReadonlySet<string> = new Set(SHOAL_ERROR_CODES)

/** True for a code this build lists (a newer peer may send one it does not). */
export function isShoalErrorCode (code: unknown): code is ShoalErrorCode {
  return typeof code === 'string' && KNOWN_CODES.has(code)
}

export class ShoalError extends Error {
  override name = 'ShoalError'
  readonly code: ShoalErrorCode
  constructor (code: ShoalErrorCode, message: string, options?: ErrorOptions) {
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

/** 503: the part asked to do work is stopping or not running (an engine, a batcher). */
export class ShuttingDownError extends ShoalError {
  override name = 'ShuttingDownError'
  constructor (message = 'engine is stopping') { super('SHOAL_ERR_SHUTTING_DOWN', message) }
}

/** 499: the caller went away (a request, or one step of it, was cancelled). */
export class AbortedError extends ShoalError {
  override name = 'AbortedError'
  constructor (message = 'request was cancelled') { super('SHOAL_ERR_ABORTED', message) }
}

/**
 * The one shape of every wire protocol's decoding error (a frame that cannot be decoded, or does
 * not fit the conversation), typed by the protocol's own subset of codes. Each protocol subclasses
 * it only to set the `name` its peers and callers see (StageWireError, InferWireError, …).
 */
export class WireFormatError<C extends ShoalErrorCode = ShoalErrorCode> extends ShoalError {
  override name = 'WireFormatError'
  declare readonly code: C
  constructor (code: C, message: string, options?: ErrorOptions) {
    super(code, message, options)
  }
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

/**
 * The error as the other side threw it. Its code is kept as it came, also one this build does not
 * list (a newer peer's): comparisons against it simply fail and `httpStatusOf` answers 500.
 */
export function deserializeError (e: SerializedError): ShoalError {
  const err = new ShoalError(e.code as ShoalErrorCode, e.message) as ShoalError & { retryAfterMs?: number, param?: string }
  err.name = e.name
  if (e.retryAfterMs !== undefined) err.retryAfterMs = e.retryAfterMs
  if (e.param !== undefined) err.param = e.param
  return err
}

export function errorCodeOf (err: unknown): string | undefined {
  const code = (err as { code?: unknown } | null)?.code
  return typeof code === 'string' ? code : undefined
}

type OpenAIErrorType = 'invalid_request_error' | 'rate_limit_error' | 'server_error'

/** "Any other failure" of docs/reference.md: the codes a client meets only as an internal failure. */
const OTHER = Object.freeze([500, 'server_error'] as const)

/**
 * code → [HTTP status, OpenAI error type]; every code has a row (the `satisfies` makes a missing
 * one a compile error). The rows spelled out are the client's catalogue (docs/reference.md lists
 * exactly those); the rest (wire, ledger, certificates, shards, CLI) are `OTHER`, as is any code a
 * peer sends that this build does not list.
 */
const HTTP = {
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
  SHOAL_ERR_INTERNAL: OTHER,
  SHOAL_ERR_SHARD_INTEGRITY: OTHER,
  SHOAL_ERR_UNSUPPORTED_ARCHITECTURE: OTHER,
  SHOAL_ERR_CHECKPOINT: OTHER,
  SHOAL_ERR_LAYER_SPLIT: OTHER,
  SHOAL_ERR_MANIFEST: OTHER,
  SHOAL_ERR_CONFIG: OTHER,
  SHOAL_ERR_INFER_UNSUPPORTED_VERSION: OTHER,
  SHOAL_ERR_INFER_UNKNOWN_KIND: OTHER,
  SHOAL_ERR_INFER_TOO_LARGE: OTHER,
  SHOAL_ERR_INFER_TRUNCATED: OTHER,
  SHOAL_ERR_INFER_MALFORMED: OTHER,
  SHOAL_ERR_INFER_UNEXPECTED_FRAME: OTHER,
  SHOAL_ERR_STAGE_CONFIG: OTHER,
  SHOAL_ERR_STAGE_UNSUPPORTED_VERSION: OTHER,
  SHOAL_ERR_STAGE_UNKNOWN_KIND: OTHER,
  SHOAL_ERR_STAGE_TOO_LARGE: OTHER,
  SHOAL_ERR_STAGE_TRUNCATED: OTHER,
  SHOAL_ERR_STAGE_MALFORMED: OTHER,
  SHOAL_ERR_STAGE_UNKNOWN_REQUEST: OTHER,
  SHOAL_ERR_STAGE_MISMATCH: OTHER,
  SHOAL_ERR_STAGE_PREFIX_GONE: OTHER,
  SHOAL_ERR_EXPERTS_UNSUPPORTED_VERSION: OTHER,
  SHOAL_ERR_EXPERTS_UNKNOWN_KIND: OTHER,
  SHOAL_ERR_EXPERTS_TOO_LARGE: OTHER,
  SHOAL_ERR_EXPERTS_TRUNCATED: OTHER,
  SHOAL_ERR_EXPERTS_MALFORMED: OTHER,
  SHOAL_ERR_EXPERTS_NOT_HELD: OTHER,
  SHOAL_ERR_KV_UNSUPPORTED_VERSION: OTHER,
  SHOAL_ERR_KV_UNKNOWN_KIND: OTHER,
  SHOAL_ERR_KV_TOO_LARGE: OTHER,
  SHOAL_ERR_KV_TRUNCATED: OTHER,
  SHOAL_ERR_KV_MALFORMED: OTHER,
  SHOAL_ERR_KV_CHECKSUM: OTHER,
  SHOAL_ERR_KV_UNEXPECTED_FRAME: OTHER,
  SHOAL_ERR_KV_MISMATCH: OTHER,
  SHOAL_ERR_KV_TIMEOUT: OTHER,
  SHOAL_ERR_KV_NOT_HELD: OTHER,
  SHOAL_ERR_KV_WRONG_MODEL: OTHER,
  SHOAL_ERR_KV_REFUSED: OTHER,
  SHOAL_ERR_MESH_NOT_ADMITTED: OTHER,
  SHOAL_ERR_MESH_NOT_RUNNING: OTHER,
  SHOAL_ERR_MESH_CONFIG: OTHER,
  SHOAL_ERR_MESH_MALFORMED: OTHER,
  SHOAL_ERR_MESH_TOO_LARGE: OTHER,
  SHOAL_ERR_MESH_UNSUPPORTED_VERSION: OTHER,
  SHOAL_ERR_MESH_UNEXPECTED_FRAME: OTHER,
  SHOAL_ERR_MESH_RATE_LIMITED: OTHER,
  SHOAL_ERR_MESH_REFUSED: OTHER,
  SHOAL_ERR_MESH_INTERNAL: OTHER,
  SHOAL_ERR_WITNESS_MALFORMED: OTHER,
  SHOAL_ERR_WITNESS_UNSUPPORTED_VERSION: OTHER,
  SHOAL_ERR_LEDGER_INVALID: OTHER,
  SHOAL_ERR_LEDGER_SIGNER: OTHER,
  SHOAL_ERR_LEDGER_CORRUPT: OTHER,
  SHOAL_ERR_CERT_MALFORMED: OTHER,
  SHOAL_ERR_CERT_UNKNOWN_FORMAT_VERSION: OTHER,
  SHOAL_ERR_CERT_WRONG_CA: OTHER,
  SHOAL_ERR_CERT_BAD_SIGNATURE: OTHER,
  SHOAL_ERR_CERT_EXPIRED: OTHER,
  SHOAL_ERR_CERT_NOT_YET_VALID: OTHER,
  SHOAL_ERR_CERT_REVOKED: OTHER,
  SHOAL_ERR_CERT_PEER_ID_MISMATCH: OTHER,
  SHOAL_ERR_CERT_FILE: OTHER,
  SHOAL_ERR_CA_EXISTS: OTHER,
  SHOAL_ERR_CA_NOT_FOUND: OTHER,
  SHOAL_ERR_CA_UNKNOWN_NODE: OTHER,
  SHOAL_ERR_CA_NAME_TAKEN: OTHER,
  SHOAL_ERR_CA_OUT_EXISTS: OTHER,
  SHOAL_ERR_CA_BAD_OPTION: OTHER,
  SHOAL_ERR_CA_BUSY: OTHER,
} as const satisfies Record<ShoalErrorCode, readonly [number, OpenAIErrorType]>

/** The HTTP status and OpenAI error type of a code (exported for the catalogue's own test). */
export function httpStatusOfCode (code: string): { status: number, type: OpenAIErrorType } {
  const entry = isShoalErrorCode(code) ? HTTP[code] : undefined
  return entry === undefined ? { status: 500, type: 'server_error' } : { status: entry[0], type: entry[1] }
}

export function httpStatusOf (err: unknown): { status: number, type: OpenAIErrorType } {
  return httpStatusOfCode(errorCodeOf(err) ?? '')
}
