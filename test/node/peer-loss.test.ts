/** createPeerLossWatch over a peer table stand-in: which liveness changes fire which signals. */
import { describe, expect, it } from 'vitest'
import type { PeerChange, PeerView } from '../../daemon/mesh/index.ts'
import { createPeerLossWatch } from '../../daemon/node/peer-loss.ts'

function table (): { views: PeerView[], emit: (peerId: string, kind: PeerChange['kind']) => void, listeners: number, mesh: Parameters<typeof createPeerLossWatch>[0] } {
  const listeners = new Set<(c: PeerChange) => void>()
  const t = {
    views: [] as PeerView[],
    emit: (peerId: string, kind: PeerChange['kind']) => { for (const l of listeners) l({ peerId, kind }) },
    get listeners () { return listeners.size },
    mesh: {
      peers: () => t.views,
      onChange: (l: (c: PeerChange) => void) => { listeners.add(l); return () => { listeners.delete(l) } },
    },
  }
  return t
}
const peer = (peerId: string, state: PeerView['state']): PeerView => ({ peerId, name: peerId, roles: [], state })

describe('peer loss watch', () => {
  it('fires a peer\'s signals when it turns suspect or leaves, and only that peer\'s', () => {
    const t = table()
    t.views = [peer('a', 'alive'), peer('b', 'alive')]
    const watch = createPeerLossWatch(t.mesh)
    const a1 = watch.watch('a')
    const a2 = watch.watch('a')
    const b = watch.watch('b')
    t.emit('a', 'load') // not a liveness change
    expect([a1.signal.aborted, a2.signal.aborted, b.signal.aborted]).toEqual([false, false, false])
    t.views = [peer('a', 'suspect'), peer('b', 'alive')]
    t.emit('a', 'liveness')
    expect([a1.signal.aborted, a2.signal.aborted, b.signal.aborted]).toEqual([true, true, false])
    t.views = [peer('a', 'suspect')]
    t.emit('b', 'gone')
    expect(b.signal.aborted).toBe(true)
    watch.stop()
    expect(t.listeners).toBe(0)
  })

  it('a peer that is not alive now gets an aborted signal at once; a released watch is not fired', () => {
    const t = table()
    t.views = [peer('a', 'suspect'), peer('c', 'alive')]
    const watch = createPeerLossWatch(t.mesh)
    expect(watch.watch('a').signal.aborted).toBe(true)
    expect(watch.watch('unknown').signal.aborted).toBe(true)
    const c = watch.watch('c')
    c.release()
    t.views = []
    t.emit('c', 'gone')
    expect(c.signal.aborted).toBe(false)
  })
})
