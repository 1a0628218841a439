import { describe, expect, it } from 'vitest'
import { meshModelCards, replicaCandidates } from '../../daemon/node/mesh-view.ts'
import type { PeerView } from '../../daemon/mesh/index.ts'

const load = { queueDepth: 1, inFlight: 2, decodeTokPerSec: 50, freeKvTokens: 100, expectedWaitMs: 30, slots: 4 }
const peer = (peerId: string, models: PeerView['capabilities'] extends infer C ? C extends { models: infer M } ? M : never : never, state: PeerView['state'] = 'alive'): PeerView => ({
  peerId, name: peerId, roles: ['worker'], state, capabilities: { models }, load, loadAt: 1000, rttMs: 3,
})

describe('mesh view mapping', () => {
  const peers = [
    peer('whole', [{ id: 'm', totalLayers: 8, maxContextTokens: 512 }]),
    peer('stage', [{ id: 'm', layers: [0, 3], totalLayers: 8 }]),
    peer('full-range', [{ id: 'm', layers: [0, 7], totalLayers: 8 }]),
    peer('other', [{ id: 'x' }]),
    peer('suspect', [{ id: 'm' }], 'suspect'),
  ]

  it('lists every peer serving the model, marks stage holders as not whole, and maps load', () => {
    const c = replicaCandidates('m', { peerId: 'me', serves: true, load }, peers, 5000)
    expect(c.map(x => [x.peerId, x.wholeModel, x.alive, x.local])).toEqual([
      ['me', true, true, true], ['whole', true, true, false], ['stage', false, true, false],
      ['full-range', true, true, false], ['suspect', true, false, false],
    ])
    expect(c[1]!.load).toEqual({ observedAt: 1000, queueDepth: 1, inFlight: 2, slots: 4, tokensPerSecond: 50, expectedQueueWaitMs: 30 })
    expect(c[0]!.load!.observedAt).toBe(5000)
    expect(replicaCandidates('m', { peerId: 'me', serves: false, load }, [], 0)).toEqual([])
  })

  it('builds one model card per whole model, from alive peers only', () => {
    expect(meshModelCards(peers)).toEqual([
      { id: 'm', created: 0, ownedBy: 'shoal', contextLength: 512, servedBy: ['whole', 'full-range'] },
      { id: 'x', created: 0, ownedBy: 'shoal', contextLength: 0, servedBy: ['other'] },
    ])
  })
})
