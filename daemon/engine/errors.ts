/**
 * Engine errors. Codes are what callers compare (they cross the worker boundary as
 * {name, code, message}); the classes exist so throw sites read clearly.
 */
import { ShoalError } from '../errors.ts'

export class ContextLengthError extends ShoalError {
  override name = 'ContextLengthError'
  constructor (message: string) { super('SHOAL_ERR_CONTEXT_LENGTH', message) }
}

/** Prompt plus max_tokens exceed the context: a 400 naming the numbers (as vLLM and OpenAI answer). */
export class RequestTooLongError extends ShoalError {
  override name = 'RequestTooLongError'
  /** The request field to change (OpenAI's `param`). */
  readonly param = 'max_tokens'
  constructor (message: string) { super('SHOAL_ERR_BAD_REQUEST', message) }
}

export class ModelNotFoundError extends ShoalError {
  override name = 'ModelNotFoundError'
  constructor (model: string, served: string[]) {
    super('SHOAL_ERR_MODEL_NOT_FOUND', `model "${model}" is not served here (serving: ${served.join(', ') || 'none'})`)
  }
}

export class OverloadedError extends ShoalError {
  override name = 'OverloadedError'
  /** When known, how long until a retry is likely to be admitted (becomes Retry-After). */
  readonly retryAfterMs: number | undefined
  constructor (message: string, retryAfterMs?: number) {
    super('SHOAL_ERR_OVERLOADED', message)
    this.retryAfterMs = retryAfterMs
  }
}

export class DeadlineError extends ShoalError {
  override name = 'DeadlineError'
  constructor (message = 'request deadline passed') { super('SHOAL_ERR_DEADLINE', message) }
}

export class AbortedError extends ShoalError {
  override name = 'AbortedError'
  constructor (message = 'request was cancelled') { super('SHOAL_ERR_ABORTED', message) }
}

/** A backend failed to load or run a graph, or an engine call was malformed. */
export class EngineError extends ShoalError {
  override name = 'EngineError'
  constructor (message: string, options?: ErrorOptions) { super('SHOAL_ERR_ENGINE', message, options) }
}

/** The requested backend (e.g. openvino-node) is not installed or cannot load on this machine. */
export class BackendUnavailableError extends ShoalError {
  override name = 'BackendUnavailableError'
  constructor (message: string, options?: ErrorOptions) { super('SHOAL_ERR_BACKEND_UNAVAILABLE', message, options) }
}

export class ShuttingDownError extends ShoalError {
  override name = 'ShuttingDownError'
  constructor (message = 'engine is stopping') { super('SHOAL_ERR_SHUTTING_DOWN', message) }
}
