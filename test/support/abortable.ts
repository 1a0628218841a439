/**
 * The waits of the test fakes (simulated-service.ts, simulated-peer.ts): a timer or a promise that
 * an AbortSignal cuts short. They reject with the signal's reason when it is an Error, else with
 * SHOAL_ERR_ABORTED (the routing server aborts with a plain `Stop` object).
 */
import { AbortedError } from '../../daemon/errors.ts'

function reasonOf (signal: AbortSignal): Error {
  return signal.reason instanceof Error ? signal.reason : new AbortedError('aborted')
}

/** Resolves after `ms`, or rejects when `signal` aborts first. */
export async function sleep (ms: number, signal: AbortSignal): Promise<void> {
  if (signal.aborted) throw reasonOf(signal)
  await new Promise<void>((resolve, reject) => {
    const onAbort = (): void => { clearTimeout(timer); reject(reasonOf(signal)) }
    const timer = setTimeout(() => { signal.removeEventListener('abort', onAbort); resolve() }, ms)
    signal.addEventListener('abort', onAbort, { once: true })
  })
}

/** `until`'s value, or a rejection when `signal` aborts first (also while `until` never settles). */
export async function untilOrAbort<T> (until: Promise<T>, signal: AbortSignal): Promise<T> {
  if (signal.aborted) throw reasonOf(signal)
  let onAbort = (): void => {}
  try {
    return await Promise.race([until, new Promise<never>((_resolve, reject) => {
      onAbort = () => { reject(reasonOf(signal)) }
      signal.addEventListener('abort', onAbort, { once: true })
    })])
  } finally {
    signal.removeEventListener('abort', onAbort)
  }
}
