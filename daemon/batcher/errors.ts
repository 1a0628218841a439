/**
 * Batcher errors. Callers compare `code` (they cross worker and wire boundaries); the classes make
 * throw sites read clearly.
 */
import { AbortedError, ShoalError } from '../errors.ts'
export { ShuttingDownError } from '../errors.ts'
import { codedAbortReason } from '../abort.ts'


/** A malformed step, or a second step for a sequence whose previous one has not finished. */
export class BadStepError extends ShoalError {
  override name = 'BadStepError'
  constructor (message: string) { super('SHOAL_ERR_BAD_REQUEST', message) }
}

/** The executor failed a run (thrown, or a malformed reply); only that run's items get it. */
export class BatchFailedError extends ShoalError {
  override name = 'BatchFailedError'
  constructor (message: string, options?: ErrorOptions) { super('SHOAL_ERR_ENGINE', message, options) }
}



/** The error an aborted wait fails with: the signal's own coded reason, else SHOAL_ERR_ABORTED. */
export function abortReason (signal: AbortSignal): Error {
  return codedAbortReason(signal, () => new AbortedError('step was cancelled'))
}

/** Keeps a coded error as it is (the engine's codes mean something); wraps anything else. */
export function asCoded (err: unknown, context: string): Error {
  if (err instanceof Error && typeof (err as { code?: unknown }).code === 'string') return err
  return new BatchFailedError(`${context}: ${err instanceof Error ? err.message : String(err)}`, { cause: err })
}
