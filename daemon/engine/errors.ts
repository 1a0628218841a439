/**
 * Engine errors. Codes are what callers compare (they cross the worker boundary as
 * {name, code, message}); the classes exist so throw sites read clearly.
 */
import { ShoalError } from '../errors.ts'
export { AbortedError, ModelNotFoundError, OverloadedError, ShuttingDownError } from '../errors.ts'

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



export class DeadlineError extends ShoalError {
  override name = 'DeadlineError'
  constructor (message = 'request deadline passed') { super('SHOAL_ERR_DEADLINE', message) }
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

