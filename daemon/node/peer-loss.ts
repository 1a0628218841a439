/**
 * Signals that fire when the mesh stops hearing from a peer: it turned suspect (no load reply
 * within the suspect bound), left the table, or lost its admission. Forwards to that peer watch
 * them (see ForwardOptions.peerLost) so a peer that died without closing anything is given up on
 * at the mesh's liveness bound, not at the stream's idle bound.
 */
import type { Mesh } from '../mesh/index.ts'

export interface PeerLossWatch {
  /** A signal for `peerId` (already aborted when the peer is not alive now); `release` when done with it. */
  watch (peerId: string): { signal: AbortSignal, release: () => void }
  stop (): void
}

export function createPeerLossWatch (mesh: Pick<Mesh, 'onChange' | 'peers'>): PeerLossWatch {
  const watchers = new Map<string, Set<AbortController>>()
  const alive = (peerId: string): boolean => mesh.peers().some(p => p.peerId === peerId && p.state === 'alive')
  const unsubscribe = mesh.onChange(change => {
    if (change.kind !== 'liveness' && change.kind !== 'gone' && change.kind !== 'refused') return
    const set = watchers.get(change.peerId)
    if (set === undefined || alive(change.peerId)) return
    for (const c of set) c.abort()
    watchers.delete(change.peerId)
  })
  return {
    watch (peerId) {
      const c = new AbortController()
      if (!alive(peerId)) {
        c.abort()
        return { signal: c.signal, release: () => {} }
      }
      const set = watchers.get(peerId) ?? new Set()
      set.add(c)
      watchers.set(peerId, set)
      return {
        signal: c.signal,
        release: () => {
          set.delete(c)
          if (set.size === 0 && watchers.get(peerId) === set) watchers.delete(peerId)
        },
      }
    },
    stop () {
      unsubscribe()
      watchers.clear()
    },
  }
}
