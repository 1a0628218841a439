/**
 * Expected CLI failures. Commands throw these; only `main` turns them into an exit code, so
 * commands stay testable as plain functions.
 */
export class ExitError extends Error {
  override name = 'ExitError'
  readonly exitCode: number
  constructor (message: string, exitCode = 2) {
    super(message)
    this.exitCode = exitCode
  }
}

/** Anything that looks like an ExitError (checked by name, so it survives module duplication). */
export function isExitError (err: unknown): err is ExitError {
  return err instanceof Error && err.name === 'ExitError' && typeof (err as ExitError).exitCode === 'number'
}
