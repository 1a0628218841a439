/**
 * The coordinator's book of keeps its chains' stages have not acknowledged yet. A stage keeps a
 * finished request's prefix after it sent its receipt part (so after the response ended): a
 * follow-up sent at once (agents do) could open from the key before a slow stage (its engine
 * worker busy) holds it, be refused and recompute. So a finish that keeps asks every stage for a
 * `kept` frame once its keep is done (wire.ts), and an open from that key first waits for those,
 * bounded: past the bound it goes on without the prefix rather than hang.
 *
 * A stage that did not answer within a wait (one that does not know the `ack` field, or is far
 * behind) is not waited for again until it acknowledges something: a peer that never answers
 * costs one bounded wait, not one per request.
 */

/** How long an open waits for the stages' keeps of its prefix (default). */
export const KEPT_WAIT_MS = 300
/** Unanswered keeps remembered (the oldest go first: a lost frame holds nothing forever). */
const MAX_PENDING = 1024
/** Peers remembered as not answering. */
const MAX_SILENT = 256

export interface KeepAcks {
  /** A finish asked `peers` to keep `key`: opens from it wait for their acknowledgements. */
  expect (key: string, peers: readonly string[]): void
  /** `peer` acknowledged keeping `key` (whatever it kept: one that kept nothing refuses the open itself). */
  ack (key: string, peer: string): void
  /**
   * Resolves true once every stage asked to keep `key` acknowledged it (at once when none is
   * pending), false when `waitMs` passed first; rejects with signal.reason when it fires.
   */
  ready (key: string, signal: AbortSignal, waitMs?: number): Promise<boolean>
  /** Keys with unanswered keeps now. */
  readonly pending: number
}

interface Pending {
  peers: Set<string>
  /** Told true when every peer answered, false when a wait's bound passed first. */
  waiters: Set<(ok: boolean) => void>
}

export function createKeepAcks (): KeepAcks {
  const pending = new Map<string, Pending>()
  const silent = new Set<string>()

  function settle (key: string, p: Pending, ok: boolean): void {
    if (pending.get(key) === p) pending.delete(key)
    for (const wake of [...p.waiters]) wake(ok)
    p.waiters.clear()
  }

  return {
    get pending () { return pending.size },
    expect (key, peers) {
      const waited = peers.filter(peer => !silent.has(peer))
      if (waited.length === 0) return
      pending.delete(key)
      pending.set(key, { peers: new Set(waited), waiters: new Set() })
      if (pending.size > MAX_PENDING) {
        // Long unanswered: an open from it tries, and a stage that does not hold it refuses.
        const [oldest, p] = pending.entries().next().value!
        settle(oldest, p, true)
      }
    },
    ack (key, peer) {
      silent.delete(peer)
      const p = pending.get(key)
      if (p === undefined) return
      p.peers.delete(peer)
      if (p.peers.size === 0) settle(key, p, true)
    },
    async ready (key, signal, waitMs = KEPT_WAIT_MS) {
      signal.throwIfAborted()
      const p = pending.get(key)
      if (p === undefined) return true
      const done = await new Promise<boolean>((resolve, reject) => {
        const finish = (ok: boolean): void => {
          clearTimeout(timer)
          signal.removeEventListener('abort', onAbort)
          p.waiters.delete(wake)
          resolve(ok)
        }
        const wake = (ok: boolean): void => { finish(ok) }
        const onAbort = (): void => {
          clearTimeout(timer)
          p.waiters.delete(wake)
          reject(signal.reason)
        }
        const timer = setTimeout(() => { finish(false) }, waitMs)
        p.waiters.add(wake)
        signal.addEventListener('abort', onAbort, { once: true })
      })
      if (!done) {
        // Not answered in time: not waited for again until it answers something.
        for (const peer of p.peers) {
          silent.delete(peer)
          silent.add(peer)
          if (silent.size > MAX_SILENT) silent.delete(silent.values().next().value!)
        }
        settle(key, p, false)
      }
      return done
    },
  }
}
