/**
 * Abort and deadline plumbing shared by every module that waits: the one clamp for timers, the
 * one race of a promise against a signal, and the one rule for what an aborted wait throws.
 */

/** The longest delay setTimeout honours; a longer one fires at once. */
export const MAX_TIMER_MS = 2 ** 31 - 1

/**
 * Resolves with `p`, or rejects as soon as `signal` aborts. Once the signal has aborted its reason
 * is what is thrown, also when `p` failed because of the abort; the loser of the race never
 * becomes an unhandled rejection.
 */
export async function raceAbort<T> (p: Promise<T>, signal: AbortSignal): Promise<T> {
  p.catch(() => {})
  if (signal.aborted) throw signal.reason
  let onAbort = (): void => {}
  const aborted = new Promise<never>((_resolve, reject) => {
    onAbort = () => { reject(signal.reason) }
    signal.addEventListener('abort', onAbort, { once: true })
  })
  try {
    return await Promise.race([p, aborted])
  } catch (err) {
    throw signal.aborted ? signal.reason : err
  } finally {
    signal.removeEventListener('abort', onAbort)
  }
}

/** The first of `signals` that has aborted, if any (signals listened to side by side, not composed). */
export function firstAborted (signals: readonly AbortSignal[]): AbortSignal | undefined {
  return signals.find(s => s.aborted)
}

/** What an aborted wait fails with: the signal's own coded reason (a ShoalError), else `fallback()`. */
export function codedAbortReason (signal: AbortSignal, fallback: () => Error): Error {
  const r: unknown = signal.reason
  if (r instanceof Error && typeof (r as { code?: unknown }).code === 'string') return r
  return fallback()
}
