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
 * costs one bounded wait, not one per request. A stage that answers it kept nothing (its budget
 * full) makes the key gone for the chain: an open from it would only be refused, so it is not
 * tried.
 */

/** How long an open waits for the stages' keeps of its prefix (default). */
export const KEPT_WAIT_MS = 300
/** Unanswered keeps remembered (the oldest go first: a lost frame holds nothing forever). */
const MAX_PENDING = 1024
/** Peers remembered as not answering. */
const MAX_SILENT = 256
/** Keys remembered as gone (a stage asked to keep one kept nothing), for opens that ask after the answer came. */
const MAX_GONE = 1024

/** What an open from a key may do: every stage holds it, a stage did not answer in time (try it), or a stage kept nothing. */
export type KeepReadiness = 'held' | 'late' | 'gone'

export interface KeepAcks {
  /** A finish asked `peers` to keep `key`: opens from it wait for their acknowledgements. */
  expect (key: string, peers: readonly string[]): void
  /** `peer` acknowledged keeping `length` positions of `key` (0: it kept none). */
  ack (key: string, peer: string, length: number): void
  /**
   * Resolves 'held' once every stage asked to keep `key` acknowledged it (at once when none is
   * pending), 'gone' as soon as one said it kept nothing (also later), 'late' when `waitMs` passed
   * first; rejects with signal.reason when it fires.
   */
  ready (key: string, signal: AbortSignal, waitMs?: number): Promise<KeepReadiness>
  /** Keys with unanswered keeps now. */
  readonly pending: number
}

interface Pending {
  peers: Set<string>
  /** Told how the key settled: every peer answered, one kept nothing, or a wait's bound passed first. */
  waiters: Set<(how: KeepReadiness) => void>
}

export function createKeepAcks (): KeepAcks {
  const pending = new Map<string, Pending>()
  const silent = new Set<string>()
  const gone = new Set<string>()

  function settle (key: string, p: Pending, how: KeepReadiness): void {
    if (pending.get(key) === p) pending.delete(key)
    for (const wake of [...p.waiters]) wake(how)
    p.waiters.clear()
  }

  return {
    get pending () { return pending.size },
    expect (key, peers) {
      // Kept again (a new finish under the same key): what was gone is asked anew.
      gone.delete(key)
      const waited = peers.filter(peer => !silent.has(peer))
      if (waited.length === 0) return
      pending.delete(key)
      pending.set(key, { peers: new Set(waited), waiters: new Set() })
      if (pending.size > MAX_PENDING) {
        // Long unanswered: an open from it tries, and a stage that does not hold it refuses.
        const [oldest, p] = pending.entries().next().value!
        settle(oldest, p, 'held')
      }
    },
    ack (key, peer, length) {
      silent.delete(peer)
      const p = pending.get(key)
      // Only a stage asked to keep the key, while it is pending, can make it gone (a late answer
      // of 0 leaves the open to be refused, as without acks).
      if (p === undefined || !p.peers.has(peer)) return
      if (length === 0) {
        gone.add(key)
        if (gone.size > MAX_GONE) gone.delete(gone.values().next().value!)
        settle(key, p, 'gone')
        return
      }
      p.peers.delete(peer)
      if (p.peers.size === 0) settle(key, p, 'held')
    },
    async ready (key, signal, waitMs = KEPT_WAIT_MS) {
      signal.throwIfAborted()
      if (gone.has(key)) return 'gone'
      const p = pending.get(key)
      if (p === undefined) return 'held'
      const done = await new Promise<KeepReadiness>((resolve, reject) => {
        const finish = (how: KeepReadiness): void => {
          clearTimeout(timer)
          signal.removeEventListener('abort', onAbort)
          p.waiters.delete(wake)
          resolve(how)
        }
        const wake = (how: KeepReadiness): void => { finish(how) }
        const onAbort = (): void => {
          clearTimeout(timer)
          p.waiters.delete(wake)
          reject(signal.reason)
        }
        const timer = setTimeout(() => { finish('late') }, waitMs)
        p.waiters.add(wake)
        signal.addEventListener('abort', onAbort, { once: true })
      })
      if (done === 'late') {
        // Not answered in time: not waited for again until it answers something.
        for (const peer of p.peers) {
          silent.delete(peer)
          silent.add(peer)
          if (silent.size > MAX_SILENT) silent.delete(silent.values().next().value!)
        }
        settle(key, p, 'late')
      }
      return done
    },
  }
}
