import { describe, expect, it } from 'vitest'
import { aggregateLoad, expertHolderNodes, meshModelCards, replicaCandidates, servedModels, stageHolders, stageStepTimes, stepTimesChanged } from '../../daemon/node/mesh-view.ts'
import type { PeerView } from '../../daemon/mesh/index.ts'
import { blockHashes, DEFAULT_BLOCK_SIZE, prefixScope, summaryHashes } from '../../daemon/kv/index.ts'
import { planPrefixRoute } from '../../daemon/routing/index.ts'

const load = { queueDepth: 1, inFlight: 2, decodeTokPerSec: 50, freeKvTokens: 100, expectedWaitMs: 30, slots: 4 }
const peer = (peerId: string, models: PeerView['capabilities'] extends infer C ? C extends { models: infer M } ? M : never : never, state: PeerView['state'] = 'alive'): PeerView => ({
  peerId, name: peerId, roles: ['worker'], state, capabilities: { models }, load, loadAt: 1000, rttMs: 3,
})

describe('mesh view mapping', () => {
  const peers = [
    peer('whole', [{ id: 'm', totalLayers: 8, maxContextTokens: 512 }]),
    peer('stage', [{ id: 'm', layers: [4, 7], totalLayers: 8, manifestHash: 'h1' }]),
    peer('stage0', [{ id: 'm', layers: [0, 3], totalLayers: 8, manifestHash: 'h1' }]),
    peer('full-range', [{ id: 'm', layers: [0, 7], totalLayers: 8 }]),
    peer('other', [{ id: 'x' }]),
    peer('suspect', [{ id: 'm' }], 'suspect'),
  ]

  it('lists every peer serving the model, entry points (whole or stage 0) apart from other stages, and maps load', () => {
    const c = replicaCandidates('m', { peerId: 'me', serves: true, load }, peers, 5000)
    expect(c.map(x => [x.peerId, x.wholeModel, x.alive, x.local])).toEqual([
      ['me', true, true, true], ['whole', true, true, false], ['stage', false, true, false], ['stage0', true, true, false],
      ['full-range', true, true, false], ['suspect', true, false, false],
    ])
    expect(c[1]!.load).toEqual({ observedAt: 1000, queueDepth: 1, inFlight: 2, slots: 4, tokensPerSecond: 50, expectedQueueWaitMs: 30 })
    expect(c[0]!.load!.observedAt).toBe(5000)
    expect(replicaCandidates('m', { peerId: 'me', serves: false, load }, [], 0)).toEqual([])
  })

  it('reads a whole-model peer\'s prefix summary in the scope its local service keys it by; this node gives its own', () => {
    const hashes = ['0123456789abcdef']
    const withPrefixes = (p: PeerView): PeerView => ({ ...p, load: { ...load, prefixes: hashes } })
    const c = replicaCandidates('m', { peerId: 'me', serves: true, load, prefixes: { scope: 'own', blockSize: 8, hashes: ['fedcba9876543210'] } }, [
      withPrefixes(peer('whole', [{ id: 'm', totalLayers: 8, manifestHash: 'h1' }])),
      // No manifest hash (the scope cannot be known), a chain's entry point (what its chains keep,
      // in the model's whole scope), nothing listed (yet).
      withPrefixes(peer('anonymous', [{ id: 'm', totalLayers: 8 }])),
      withPrefixes(peer('stage0', [{ id: 'm', layers: [0, 3], totalLayers: 8, manifestHash: 'h1' }])),
      peer('empty', [{ id: 'm', totalLayers: 8, manifestHash: 'h1' }]),
    ], 5000)
    expect(c.map(x => [x.peerId, x.prefixes])).toEqual([
      ['me', { scope: 'own', blockSize: 8, hashes: ['fedcba9876543210'] }],
      ['whole', { scope: prefixScope({ manifestHash: 'h1', layers: [0, 7], dtype: 'float32' }), blockSize: DEFAULT_BLOCK_SIZE, hashes }],
      ['anonymous', undefined],
      ['stage0', { scope: prefixScope({ manifestHash: 'h1', layers: [0, 7], dtype: 'float32' }), blockSize: DEFAULT_BLOCK_SIZE, hashes }],
      ['empty', { scope: prefixScope({ manifestHash: 'h1', layers: [0, 7], dtype: 'float32' }), blockSize: DEFAULT_BLOCK_SIZE, hashes: [] }],
    ])
    // A peer's measured prefill rate (its load reply) is what routing weighs its kept prefix by.
    const rated = replicaCandidates('m', { peerId: 'me', serves: false, load }, [
      { ...peer('whole', [{ id: 'm', totalLayers: 8, manifestHash: 'h1' }]), load: { ...load, prefixes: hashes, prefillTokPerSec: 1800 } },
    ], 5000)
    expect(rated[0]!.prefixes?.prefillTokensPerSecond).toBe(1800)
  })

  it('a follow-up goes to the chain entry point whose chains keep its history (its summary read in the whole scope)', () => {
    const scope = prefixScope({ manifestHash: 'h1', layers: [0, 7], dtype: 'float32' })
    const history = Array.from({ length: 600 }, (_, i) => 3 + (i * 11) % 400)
    const followUp = [...history, 9, 8, 7, 6, 5]
    // What the coordinator's prefixSummary lists after its chain kept the history.
    const hashes = summaryHashes([blockHashes(scope, history, DEFAULT_BLOCK_SIZE)], 64)
    const chainPeer = (peerId: string, prefixes?: string[]): PeerView => ({ ...peer(peerId, [{ id: 'm', layers: [0, 3], totalLayers: 8, manifestHash: 'h1' }]), load: { ...load, ...(prefixes === undefined ? {} : { prefixes }), prefillTokPerSec: 500 } })
    const c = replicaCandidates('m', { peerId: 'me', serves: false, load }, [chainPeer('c1'), chainPeer('c2', hashes)], 1000)
    const r = planPrefixRoute(c, followUp, { now: 1000, expectedTokens: 16 })
    expect(r.cached).toEqual(new Map([['c2', Math.floor(history.length / DEFAULT_BLOCK_SIZE) * DEFAULT_BLOCK_SIZE]]))
    expect(r.preference).toMatchObject({ peerId: 'c2' })
    // Another conversation finds nothing there.
    expect(planPrefixRoute(c, followUp.map(t => t + 1), { now: 1000 }).preference).toBeUndefined()
  })

  it('builds one model card per model servable whole or as a complete chain, from alive peers only', () => {
    expect(meshModelCards(peers)).toEqual([
      { id: 'm', created: 0, ownedBy: 'shoal', contextLength: 512, servedBy: ['whole', 'stage0', 'full-range'] },
      { id: 'x', created: 0, ownedBy: 'shoal', contextLength: 0, servedBy: ['other'] },
    ])
  })
})

describe('chains in the mesh view', () => {
  it('lists a chained model only while its stages cover every layer', () => {
    const s0 = peer('s0', [{ id: 'c', layers: [0, 3], totalLayers: 8, manifestHash: 'h' }])
    const s1 = peer('s1', [{ id: 'c', layers: [4, 7], totalLayers: 8, manifestHash: 'h' }])
    const other = peer('s1-other-build', [{ id: 'c', layers: [4, 7], totalLayers: 8, manifestHash: 'h2' }])
    expect(meshModelCards([s0, s1]).map(c => c.id)).toEqual(['c'])
    expect(meshModelCards([s0])).toEqual([])
    expect(meshModelCards([s0, other])).toEqual([])
    expect(stageHolders('c', [s0, s1]).map(h => [h.peerId, h.layers])).toEqual([['s0', [0, 3]], ['s1', [4, 7]]])
  })
})

describe('node load', () => {
  it('sums engines and chain requests, keeps the worst expected wait, never reports zero slots', () => {
    const e = (q: number, active: number, wait: number) => ({ queueDepth: q, inFlight: 0, expectedWaitMs: wait, decodeTokensPerSecond: 3, capacityTokensPerSecond: 10, slots: 8, activeSequences: active })
    expect(aggregateLoad([e(1, 2, 30), e(0, 3, 80)], 1)).toEqual({ queueDepth: 1, inFlight: 6, decodeTokPerSec: 20, freeKvTokens: 0, expectedWaitMs: 80, slots: 16 })
    expect(aggregateLoad([], 0).slots).toBe(1)
    // Requests waiting for a chain slot (a sole server's) queue on top of the engines' queues.
    expect(aggregateLoad([e(1, 2, 30)], 1, [], [], 2)).toMatchObject({ queueDepth: 3, inFlight: 3 })
  })

  it('carries the engines\' merged prefix summary, and no field when there is none', () => {
    expect(aggregateLoad([], 0, ['0123456789abcdef']).prefixes).toEqual(['0123456789abcdef'])
    expect(aggregateLoad([], 0, [])).not.toHaveProperty('prefixes')
    // The slowest measured prefill rate of the node's engines; none measured: absent.
    expect(aggregateLoad([], 0, [], [undefined, 4000, 0, 2500]).prefillTokPerSec).toBe(2500)
    expect(aggregateLoad([], 0, [], [undefined, 0])).not.toHaveProperty('prefillTokPerSec')
  })

  it('declares the drafter on the models requests enter by (whole models and stage 0), not on later stages', () => {
    const manifest = (first: number, last: number) => ({ modelId: 'm', shape: { numLayers: 8, maxPositions: 64 }, stages: [{ layers: [first, last] }] }) as never
    const whole = { manifest: manifest(0, 7), manifestHash: 'h', stageIndex: 0, whole: true } as never
    const first = { manifest: manifest(0, 3), manifestHash: 'h', stageIndex: 0, whole: false } as never
    const second = { manifest: manifest(4, 7), manifestHash: 'h', stageIndex: 0, whole: false } as never
    expect(servedModels([whole, first, second], 'prompt-lookup').map(m => m.drafter)).toEqual(['prompt-lookup', 'prompt-lookup', undefined])
    expect(servedModels([whole]).map(m => m.drafter)).toEqual([undefined])
    // Per model (the default prompt lookup skips some): still only where requests enter.
    const byModel = (m: { whole: boolean }) => m.whole ? 'prompt-lookup (default)' : undefined
    expect(servedModels([whole, first, second], byModel as never).map(m => m.drafter)).toEqual(['prompt-lookup (default)', undefined, undefined])
  })

  it('finds the live worker holders of one expert-parallel model with the memory they offer', () => {
    const holder = (peerId: string, key: string, budgetBytes: number, state: PeerView['state'] = 'alive', roles = ['worker']): PeerView => ({
      peerId, name: peerId, roles, state, capabilities: { models: [], experts: [{ model: key, modelId: 'moe', budgetBytes }] },
    })
    const view = [holder('a', 'k1', 100), holder('b', 'k2', 200), holder('c', 'k1', 300, 'suspect'), holder('d', 'k1', 400, 'alive', ['ingress']), holder('e', 'k1', 500), peer('whole', [{ id: 'm' }])]
    expect(expertHolderNodes('k1', view)).toEqual([{ peerId: 'a', freeBytes: 100 }, { peerId: 'e', freeBytes: 500 }])
    expect(expertHolderNodes('k3', view)).toEqual([])
  })
})

describe('measured stage speed in the capabilities', () => {
  const manifest = (first: number, last: number) => ({ modelId: 'm', shape: { numLayers: 8, maxPositions: 64 }, stages: [{ layers: [first, last] }] }) as never
  const stage = (hash: string, layers: [number, number], ms: number | undefined) => ({ served: () => ({ manifestHash: hash, layers }), node: { stepMs: () => ms } })

  it('gossips each loaded stage\'s step time (rounded to 0.1 ms), none for whole models or unmeasured stages, and chains see it', () => {
    const times = stageStepTimes([stage('h', [0, 3], 12.345), stage('h', [4, 7], undefined)])
    expect([...times]).toEqual([['h@0-3', 12.3]])
    const first = { manifest: manifest(0, 3), manifestHash: 'h', stageIndex: 0, whole: false } as never
    const second = { manifest: manifest(4, 7), manifestHash: 'h', stageIndex: 0, whole: false } as never
    const whole = { manifest: manifest(0, 7), manifestHash: 'h', stageIndex: 0, whole: true } as never
    expect(servedModels([first, second, whole], undefined, times).map(m => m.stepMs)).toEqual([12.3, undefined, undefined])
    // Each model says the devices it runs on here (a local chain: one per stage); none given: absent.
    const devices = new Map<unknown, string[]>([[whole, ['CPU', 'NPU']]])
    expect(servedModels([first, whole], undefined, times, m => devices.get(m) ?? ['CPU']).map(m => m.devices)).toEqual([['CPU'], ['CPU', 'NPU']])
    expect(servedModels([first], undefined, times)[0]).not.toHaveProperty('devices')
    // shoal's own kernels, where a model runs on them; none: absent.
    expect(servedModels([first, whole], undefined, times, undefined, m => m === whole ? ['int4'] : []).map(m => m.kernels)).toEqual([undefined, ['int4']])
    const s0 = peer('s0', [{ id: 'c', layers: [0, 3], totalLayers: 8, manifestHash: 'h', stepMs: 12.3 }])
    expect(stageHolders('c', [s0])[0]!.stepMs).toBe(12.3)
  })

  it('re-publishes when a stage is first measured or moves by more than a quarter, not for drift', () => {
    const was = new Map([['h@0-3', 10]])
    expect(stepTimesChanged(was, new Map([['h@0-3', 12]]))).toBe(false)
    expect(stepTimesChanged(was, new Map([['h@0-3', 13]]))).toBe(true)
    expect(stepTimesChanged(was, new Map([['h@0-3', 7]]))).toBe(true)
    expect(stepTimesChanged(was, new Map([['h@0-3', 10], ['h@4-7', 9]]))).toBe(true)
    expect(stepTimesChanged(was, new Map())).toBe(false)
  })
})
