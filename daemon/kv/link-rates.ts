/**
 * What this node has measured of each peer's link for KV pulls: the bytes per second of the pulls
 * it took from that peer (an exponential moving average), bounded in peers. Pure bookkeeping: the
 * caller measures, this only remembers and answers.
 *
 * Why per peer, and why a peer never measured is judged optimistically: a link's rate is only ever
 * measured by a pull over it, and a pull only happens when the cost model (decide.ts shouldPull)
 * says it pays. Judged at a pessimistic default (100 Mbit/s), a node whose own measured prefill is
 * faster than that never pulls, so never learns that its link is a 10 Gbit/s LAN or loopback: KV
 * mobility silently off on every node that has served anything (measured through real daemons:
 * test/mesh-e2e/kv-move.test.ts). So the first pull from a peer is a probe judged at
 * PROBE_LINK_BYTES_PER_SECOND and bounded like every pull (pullWaitMs, then recomputed); what it
 * measures — or, when it ran out of time, the most its link can have done — decides every later
 * pull from that peer. One average over all peers would let a slow peer's pulls veto a fast one's.
 */

/** The rate a peer's link is judged at before any pull from it was measured: 1 Gbit/s. */
export const PROBE_LINK_BYTES_PER_SECOND = 125_000_000
/** Peers remembered (least recently used forgotten first, and probed again). */
export const MAX_LINK_PEERS = 256
/** Weight of the newest measurement in the moving average. */
const NEW_WEIGHT = 0.3

export interface LinkEstimate {
  bytesPerSecond: number
  /** False: nothing measured from this peer yet (the probe rate). */
  measured: boolean
}

export interface LinkRates {
  /** The rate to judge a pull from `peerId` at. */
  estimate (peerId: string): LinkEstimate
  /** A pull from `peerId` moved `bytes` in `ms` (request to imported). */
  record (peerId: string, bytes: number, ms: number): void
  /**
   * A pull of up to `bytes` from `peerId` was given up after `ms`: its link did less than
   * bytes / ms. The estimate becomes at most that bound (never raised by a timeout).
   */
  recordTimeout (peerId: string, bytes: number, ms: number): void
}

export function createLinkRates (maxPeers = MAX_LINK_PEERS): LinkRates {
  const rates = new Map<string, number>()
  const set = (peerId: string, v: number): void => {
    rates.delete(peerId)
    rates.set(peerId, v)
    while (rates.size > maxPeers) rates.delete(rates.keys().next().value!)
  }
  const valid = (bytes: number, ms: number): boolean => Number.isFinite(bytes) && Number.isFinite(ms) && bytes > 0 && ms > 0
  return {
    estimate (peerId) {
      const v = rates.get(peerId)
      return v === undefined ? { bytesPerSecond: PROBE_LINK_BYTES_PER_SECOND, measured: false } : { bytesPerSecond: v, measured: true }
    },
    record (peerId, bytes, ms) {
      if (!valid(bytes, ms)) return
      const v = bytes / ms * 1000
      const old = rates.get(peerId)
      set(peerId, old === undefined ? v : (1 - NEW_WEIGHT) * old + NEW_WEIGHT * v)
    },
    recordTimeout (peerId, bytes, ms) {
      if (!valid(bytes, ms)) return
      const bound = bytes / ms * 1000
      set(peerId, Math.min(rates.get(peerId) ?? bound, bound))
    },
  }
}
