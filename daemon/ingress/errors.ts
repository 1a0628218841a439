/**
 * The ingress's one way to answer with an error: OpenAI's shape
 * `{"error":{"message","type","param","code"}}`, the status from `httpStatusOf` (daemon/errors.ts),
 * and fastify's own errors (bad JSON, body too large, schema validation) reshaped into it.
 */
import { STATUS_CODES } from 'node:http'
import type { FastifyReply } from 'fastify'
import { ShoalError, errorCodeOf, httpStatusOf, type ShoalErrorCode } from '../errors.ts'

/** A client mistake that names the request field at fault (OpenAI's `param`). */
export class RequestError extends ShoalError {
  override name = 'RequestError'
  readonly param: string | null
  constructor (code: ShoalErrorCode, message: string, param: string | null = null) {
    super(code, message)
    this.param = param
  }
}

export function badRequest (message: string, param: string | null = null): RequestError {
  return new RequestError('SHOAL_ERR_BAD_REQUEST', message, param)
}

export function unsupported (param: string, message?: string): RequestError {
  return new RequestError('SHOAL_ERR_UNSUPPORTED_PARAMETER', message ?? `'${param}' is not supported by this server`, param)
}

export interface OpenAIErrorBody {
  error: { message: string, type: string, param: string | null, code: string }
}

/** The body and status for any thrown value; unknown errors are 500 without their internals. */
export function describeError (err: unknown): { status: number, body: OpenAIErrorBody } {
  const { status, type } = httpStatusOf(err)
  const code = errorCodeOf(err)
  const known = code?.startsWith('SHOAL_ERR_') === true
  // An internal error's message is for the logs, not the client — also when it came from a peer.
  const message = known && code !== 'SHOAL_ERR_INTERNAL' && err instanceof Error ? err.message : 'Internal server error'
  const param = (err as { param?: unknown } | null)?.param
  return {
    status,
    body: {
      error: {
        message,
        type,
        param: typeof param === 'string' ? param : null,
        code: known ? code as string : 'SHOAL_ERR_INTERNAL',
      },
    },
  }
}

/** Seconds a client should wait before retrying an overloaded or unavailable server, unless the error says. */
const RETRY_AFTER_SECONDS = 1

/** An error's own wait estimate (the batcher's or the admission's), ms; undefined when it has none. */
function retryAfterMs (err: unknown): number | undefined {
  const ms = (err as { retryAfterMs?: unknown } | null)?.retryAfterMs
  return typeof ms === 'number' && Number.isFinite(ms) && ms > 0 ? ms : undefined
}

/** Whole seconds from the error's estimate, at least 1 (HTTP's Retry-After has no fractions). */
function retryAfterSeconds (err: unknown): number {
  const ms = retryAfterMs(err)
  return ms === undefined ? RETRY_AFTER_SECONDS : Math.max(1, Math.ceil(ms / 1000))
}

/** The single error reply. Extra headers (e.g. the receipt id) are kept if already set. */
export function sendError (reply: FastifyReply, err: unknown): FastifyReply {
  const { status, body } = describeError(err)
  if (status >= 500 && body.error.code === 'SHOAL_ERR_INTERNAL') reply.log.error({ err }, 'internal error')
  if (status === 429 || status === 503) {
    reply.header('retry-after', String(retryAfterSeconds(err)))
    // The estimate itself for clients that read it (the openai SDKs honour retry-after-ms): a wait
    // of 200 ms need not become a whole second of idle slots.
    const ms = retryAfterMs(err)
    if (ms !== undefined) reply.header('retry-after-ms', String(Math.ceil(ms)))
  }
  return reply.code(status).type('application/json; charset=utf-8').send(body)
}

interface AjvError { instancePath: string, keyword: string, message?: string, params: Record<string, unknown> }

/** '/messages/0/content' → 'messages[0].content' */
function paramOf (instancePath: string, missing?: unknown): string | null {
  const parts = instancePath.split('/').slice(1)
  if (typeof missing === 'string') parts.push(missing)
  let out = ''
  for (const p of parts) out += /^\d+$/.test(p) ? `[${p}]` : (out === '' ? p : `.${p}`)
  return out === '' ? null : out
}

/** Turns fastify's framework errors into shoal errors; anything else passes through unchanged. */
export function fromFastifyError (err: unknown): unknown {
  const e = err as { code?: unknown, statusCode?: unknown, validation?: AjvError[], message?: string } | null
  if (e == null || typeof e !== 'object') return err
  if (Array.isArray(e.validation) && e.validation.length > 0) {
    const first = e.validation[0] as AjvError
    const param = paramOf(first.instancePath, first.params.missingProperty)
    if (first.keyword === 'required') return badRequest(`Missing required parameter: '${param ?? ''}'`, param)
    const reasons = e.validation
      .filter(v => v.instancePath === first.instancePath && v.keyword !== 'anyOf' && v.keyword !== 'oneOf')
      .map(v => v.message ?? v.keyword)
    const unique = [...new Set(reasons)]
    // ajv says 'must be string', 'must be null', …: merge into 'must be string or null'.
    const reason = unique.every(r => r.startsWith('must be '))
      ? `must be ${unique.map(r => r.slice('must be '.length)).join(' or ')}`
      : unique.join('; ')
    const where = param === null ? 'request body' : `'${param}'`
    return badRequest(`Invalid value for ${where}: ${reason}`, param)
  }
  switch (e.code) {
    case 'FST_ERR_BAD_URL':
      return badRequest('The URL is not valid: a path segment is not a valid percent-encoded component')
    case 'FST_ERR_MAX_PARAM_LENGTH':
      return new RequestError('SHOAL_ERR_URI_TOO_LONG', 'The URL is too long')
    case 'FST_ERR_CTP_BODY_TOO_LARGE':
      return new RequestError('SHOAL_ERR_BODY_TOO_LARGE', 'Request body is too large')
    case 'FST_ERR_CTP_INVALID_JSON_BODY':
      return badRequest('Request body is not valid JSON')
    case 'FST_ERR_CTP_EMPTY_JSON_BODY':
      return badRequest('Request body is empty')
    case 'FST_ERR_CTP_INVALID_MEDIA_TYPE':
      return badRequest('Content-Type must be application/json')
  }
  // Other client errors from the framework or the JSON parser (a SyntaxError with statusCode 400).
  if (typeof e.statusCode === 'number' && e.statusCode >= 400 && e.statusCode < 500 && errorCodeOf(err)?.startsWith('SHOAL_ERR_') !== true) {
    return e.statusCode === 413
      ? new RequestError('SHOAL_ERR_BODY_TOO_LARGE', 'Request body is too large')
      : badRequest(e.message ?? 'Bad request')
  }
  return err
}

/**
 * Errors Node's HTTP parser finds before there is a request to reply to (a malformed request
 * line, headers past the size limit, a client too slow to send them): answered on the raw socket,
 * still in OpenAI's shape, then the socket is closed (what Node and fastify do by default, in
 * their own shapes).
 */
export function clientErrorResponse (err: { code?: unknown }): string {
  const shoal = err.code === 'HPE_HEADER_OVERFLOW'
    ? new RequestError('SHOAL_ERR_HEADERS_TOO_LARGE', 'The request headers (or its URL) are too large')
    : err.code === 'ERR_HTTP_REQUEST_TIMEOUT'
      ? new RequestError('SHOAL_ERR_CLIENT_TIMEOUT', 'The request was not received in time')
      : badRequest('The request is not valid HTTP')
  const { status, body } = describeError(shoal)
  const text = JSON.stringify(body)
  return `HTTP/1.1 ${status} ${STATUS_CODES[status] ?? 'Error'}\r\nContent-Length: ${Buffer.byteLength(text)}\r\nContent-Type: application/json; charset=utf-8\r\nConnection: close\r\n\r\n${text}`
}
