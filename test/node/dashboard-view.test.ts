/**
 * The dashboard's content as a pure function: peers with admission and reasons, models as whole /
 * replicas / chains (stages, holders, missing layers when a holder is not alive), this node's
 * queues, and the recent receipts newest first with their routes named.
 */
import { describe, expect, it } from 'vitest'
import { dashboardState, modelsServed } from '../../daemon/node/dashboard-view.ts'
import type { DashboardInput } from '../../daemon/node/dashboard-view.ts'
import type { MeshSnapshot } from '../../daemon/mesh/index.ts'
import type { SignedReceipt } from '../../daemon/ledger/index.ts'

const load = { queueDepth: 1, inFlight: 2, decodeTokPerSec: 55.55, freeKvTokens: 0, expectedWaitMs: 12.4, slots: 8 }

const mesh: MeshSnapshot = {
  self: { peerId: 'P-self', name: 'node-a', roles: ['ingress', 'worker'], addrs: ['/ip4/127.0.0.1/tcp/1'], models: [], certificateExpiresAt: '2030-01-01T00:00:00Z', certificateExpiresSoon: false },
  peers: [
    { peerId: 'P-refused', name: 'zz-evil', admitted: false, reason: 'revoked', state: 'alive', models: [{ id: 'tiny', manifestHash: 'h1', layers: [0, 3], totalLayers: 4 }] },
    { peerId: 'P-d', name: 'node-d', admitted: true, state: 'suspect', models: [{ id: 'tiny', manifestHash: 'h1', layers: [2, 3], totalLayers: 4 }] },
    { peerId: 'P-b', name: 'node-b', admitted: true, state: 'alive', rttMs: 0.83, load, models: [{ id: 'tiny', manifestHash: 'h0' }] },
    { peerId: 'P-c', name: 'node-c', admitted: true, state: 'alive', models: [{ id: 'tiny', manifestHash: 'h1', layers: [0, 1], totalLayers: 4 }] },
  ],
}

function receipt (id: string, index: number, route: SignedReceipt['body']['route']): SignedReceipt {
  return {
    signature: 'x',
    body: {
      format: 'shoal.receipt/1', index, id, signer: 'P-self', timestamp: 1000 + index, prevHash: '0'.repeat(64),
      requestHash: '1'.repeat(64), responseHash: '2'.repeat(64), model: { id: 'tiny', manifestHash: 'h0' }, route, parts: [],
      usage: { promptTokens: 5, completionTokens: 7 }, timing: { startedAt: 1, firstTokenMs: 3, totalMs: 9 }, finishReason: 'length',
    },
  }
}

const input: DashboardInput = {
  now: 5000,
  self: { peerId: 'P-self', engine: 'onnxruntime', device: 'CPU', apiUrl: 'http://127.0.0.1:1' },
  models: [{ id: 'tiny', manifestHash: 'h0', totalLayers: 4, maxContextTokens: 128 }],
  mesh,
  engines: [{ model: 'tiny', load: { queueDepth: 3, inFlight: 2, expectedWaitMs: 40.2, decodeTokensPerSecond: 100.04, slots: 8, activeSequences: 5, capacityTokensPerSecond: 120 } }],
  stages: [],
  chainRequests: 0,
  nodeLoad: load,
  receipts: [receipt('r-old', 0, [{ peerId: 'P-b' }]), receipt('r-new', 1, [{ peerId: 'P-c', layers: [0, 1] }, { peerId: 'P-unknown', layers: [2, 3] }])],
  receiptCount: 2,
}

describe('dashboardState', () => {
  const state = dashboardState(input)

  it('lists this node and its peers: admitted first, then by name; refusals keep their reason', () => {
    expect(state.mode).toBe('node')
    expect(state.self).toMatchObject({ peerId: 'P-self', name: 'node-a', self: true, engine: 'onnxruntime', apiUrl: 'http://127.0.0.1:1', models: ['tiny'] })
    expect(state.peers.map(p => p.name)).toEqual(['node-b', 'node-c', 'node-d', 'zz-evil'])
    expect(state.peers[3]).toMatchObject({ admitted: false, reason: 'revoked' })
    expect(state.peers[0]).toMatchObject({ rttMs: 0.8, load: { inFlight: 2, queueDepth: 1, slots: 8, expectedWaitMs: 12, decodeTokPerSec: 55.6 } })
    expect(state.peers[1]!.models).toEqual(['tiny@0-1'])
  })

  it('says how each model is served: replicas of the whole model plus a chain missing the suspect stage; refused peers count for nothing', () => {
    expect(state.models).toHaveLength(1)
    const m = state.models[0]!
    expect(m.servedAs).toBe('replicas + chain (incomplete)')
    expect(m.whole.map(h => h.peerId)).toEqual(['P-self', 'P-b'])
    expect(m.chains).toHaveLength(1)
    expect(m.chains[0]).toMatchObject({ manifestHash: 'h1', totalLayers: 4, missing: [[2, 3]], complete: false })
    expect(m.chains[0]!.stages.map(s => [s.layers, s.holders.map(h => h.peerId)])).toEqual([[[0, 1], ['P-c']], [[2, 3], ['P-d']]])
  })

  it('shows this node\'s engine queues and the recent requests newest first, route hops named', () => {
    expect(state.load.engines).toEqual([{ model: 'tiny', slots: 8, activeSequences: 5, queueDepth: 3, inFlight: 2, expectedWaitMs: 40, decodeTokensPerSecond: 100 }])
    expect(state.requests.map(r => r.id)).toEqual(['r-new', 'r-old'])
    expect(state.requests[0]!.route).toEqual([{ peerId: 'P-c', name: 'node-c', layers: [0, 1] }, { peerId: 'P-unknown', layers: [2, 3] }])
    expect(state.receiptCount).toBe(2)
  })

  it('shows each staged MoE model\'s holders × expert counts per layer (named, live or not, excluded), the fewest copies, and what this node holds', () => {
    const s = dashboardState({
      ...input,
      experts: {
        plans: [{
          model: 'moe', key: 'k'.repeat(64),
          layers: [
            { layer: 3, holders: { 'P-b': [0, 1], 'P-gone': [1, 2, 3], 'P-d': [0, 2, 3] } },
            { layer: 1, holders: { 'P-b': [0, 1, 2, 3], 'P-d': [0, 1, 2, 3] } },
          ],
          nodes: [{ peerId: 'P-b' }, { peerId: 'P-d' }, { peerId: 'P-gone' }],
          excluded: ['P-gone'], steps: 9, bytesOut: 100, bytesIn: 50,
        }],
        holding: { model: 'moe', key: 'k'.repeat(64), budgetBytes: 2048, resident: [{ layer: 3, experts: [4] }, { layer: 1, experts: [0, 2] }], steps: 4 },
      },
    })
    const plan = s.experts.plans[0]!
    expect(plan).toMatchObject({ model: 'moe', layers: [1, 3], minCopies: [2, 2], steps: 9, bytesOut: 100, bytesIn: 50 })
    expect(plan.holders).toEqual([
      { peerId: 'P-b', name: 'node-b', self: false, state: 'alive', counts: [4, 2], total: 6, excluded: false },
      { peerId: 'P-d', name: 'node-d', self: false, state: 'suspect', counts: [4, 3], total: 7, excluded: false },
      // Not in the mesh any more: shown as suspect, and excluded after failing a step.
      { peerId: 'P-gone', self: false, state: 'suspect', counts: [0, 3], total: 3, excluded: true },
    ])
    expect(s.experts.holding).toEqual({ model: 'moe', key: 'k'.repeat(64), budgetBytes: 2048, counts: [{ layer: 1, experts: 2 }, { layer: 3, experts: 1 }], total: 3, steps: 4 })
    // A node with no MoE models: an empty list, no holding.
    expect(state.experts).toEqual({ plans: [] })
  })

  it('without a mesh it is a single machine', () => {
    const { mesh: _m, ...serve } = input
    const s = dashboardState(serve)
    expect(s.mode).toBe('serve')
    expect(s.peers).toEqual([])
    expect(s.models[0]!.servedAs).toBe('whole')
  })
})

describe('modelsServed', () => {
  it('a chain whose alive stages cover every layer is complete', () => {
    const holder = (peerId: string) => ({ node: { peerId, self: false, state: 'alive' as const }, models: [] })
    const models = modelsServed([
      { ...holder('a'), models: [{ id: 'm', manifestHash: 'h', layers: [0, 1], totalLayers: 4 }] },
      { ...holder('b'), models: [{ id: 'm', manifestHash: 'h', layers: [2, 3], totalLayers: 4 }] },
    ])
    expect(models).toEqual([{ id: 'm', servedAs: 'chain', whole: [], chains: [{ manifestHash: 'h', totalLayers: 4, missing: [], complete: true, stages: [{ layers: [0, 1], holders: [{ peerId: 'a', self: false, state: 'alive' }] }, { layers: [2, 3], holders: [{ peerId: 'b', self: false, state: 'alive' }] }] }] }])
  })
})
