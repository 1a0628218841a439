/**
 * The waits of the test fakes (simulated-service.ts, simulated-peer.ts), over the daemon's own
 * `raceAbort`. They reject with the signal's reason when it is an Error, else with
 * SHOAL_ERR_ABORTED (the routing server aborts with a plain `Stop` object).
 */
import { raceAbort } from '../../daemon/abort.ts'
import { AbortedError } from '../../daemon/errors.ts'

/** `until`'s value, or a rejection when `signal` aborts first (also while `until` never settles). */
export async function untilOrAbort<T> (until: Promise<T>, signal: AbortSignal): Promise<T> {
  try {
    return await raceAbort(until, signal)
  } catch (err) {
    if (!signal.aborted) throw err
    throw signal.reason instanceof Error ? signal.reason : new AbortedError('aborted')
  }
}

/** Resolves after `ms`, or rejects when `signal` aborts first. */
export async function sleep (ms: number, signal: AbortSignal): Promise<void> {
  let timer: ReturnType<typeof setTimeout> | undefined
  try {
    await untilOrAbort(new Promise<void>(resolve => { timer = setTimeout(resolve, ms) }), signal)
  } finally {
    clearTimeout(timer)
  }
}
