/**
 * Maps the mesh's peer table onto the plain data routing decides over, and this node's models onto
 * the capability record it gossips. Pure functions: the daemon gathers, these translate.
 */
import type { Capabilities, LoadRecord, PeerView } from '../mesh/index.ts'
import { uncovered } from '../routing/index.ts'
import type { Candidate, LayerRange, PrefixHoldings, StageHolder } from '../routing/index.ts'
import { DEFAULT_BLOCK_SIZE, prefixScope } from '../kv/index.ts'
import type { LocalServiceLoad } from '../engine/index.ts'
import type { ModelCard } from '../service.ts'
import type { ResolvedModel } from './models.ts'
import { ACCEPTED_ENCODINGS } from '../pipeline/index.ts'

/** Key of one loaded stage in a step-time map: manifest hash and layer range. */
export const stageKey = (manifestHash: string, layers: readonly [number, number]): string => `${manifestHash}@${layers[0]}-${layers[1]}`

/** The measured decode step time of each loaded pipeline stage that has one, by stageKey (rounded to 0.1 ms). */
export function stageStepTimes (stages: ReadonlyArray<{ served: () => { manifestHash: string, layers: [number, number] }, node: { stepMs: () => number | undefined } }>): Map<string, number> {
  const out = new Map<string, number>()
  for (const s of stages) {
    const ms = s.node.stepMs()
    if (ms !== undefined && Number.isFinite(ms)) out.set(stageKey(s.served().manifestHash, s.served().layers), Math.round(ms * 10) / 10)
  }
  return out
}

/**
 * Whether measured step times moved enough to gossip a new capability record: a stage measured
 * for the first time, or one off by more than `tolerance` (relative) from what was published.
 * Records are signed and flooded, so small drifts stay local.
 */
export function stepTimesChanged (published: ReadonlyMap<string, number>, current: ReadonlyMap<string, number>, tolerance = 0.25): boolean {
  for (const [key, ms] of current) {
    const was = published.get(key)
    if (was === undefined || Math.abs(ms - was) > tolerance * Math.max(was, 0.1)) return true
  }
  return false
}

/**
 * `drafter`: speculative decoding's drafter name (one for all, or per model: the default prompt
 * lookup skips some), declared for the models requests enter here by.
 * `stepTimes`: measured decode step times of the loaded stages (stageStepTimes), gossiped per stage.
 * `kernelsOf`: shoal's own kernels a model runs on here (ServedModel.kernels).
 */
export function servedModels (models: ResolvedModel[], drafterOf?: string | ((m: ResolvedModel) => string | undefined), stepTimes?: ReadonlyMap<string, number>, devicesOf?: (m: ResolvedModel) => string[] | undefined, kernelsOf?: (m: ResolvedModel) => string[]): Capabilities['models'] {
  return models.map(m => {
    const devices = devicesOf?.(m)
    const kernels = kernelsOf?.(m) ?? []
    const drafter = typeof drafterOf === 'function' ? drafterOf(m) : drafterOf
    const stage = m.manifest.stages[m.stageIndex]!
    const stepMs = m.whole || m.localChain === true ? undefined : stepTimes?.get(stageKey(m.manifestHash, [stage.layers[0], stage.layers[1]]))
    return {
      id: m.manifest.modelId,
      manifestHash: m.manifestHash,
      // A whole model carries no layer range (the capability format's convention); so does a
      // local chain, which serves the whole model from this node.
      ...(m.whole || m.localChain === true ? {} : { layers: [stage.layers[0], stage.layers[1]] as [number, number] }),
      totalLayers: m.manifest.shape.numLayers,
      maxContextTokens: m.manifest.shape.maxPositions,
      // Whole models, local chains and stage 0 (which coordinates its chains) draft.
      ...(drafter !== undefined && (m.whole || m.localChain === true || stage.layers[0] === 0) ? { drafter } : {}),
      ...(stepMs === undefined ? {} : { stepMs }),
      // Stages receive activations; they decode every lossy encoding this build has.
      ...(m.whole || m.localChain === true || stage.layers[0] === 0 ? {} : { activations: [...ACCEPTED_ENCODINGS] }),
      ...(devices === undefined || devices.length === 0 ? {} : { devices }),
      ...(kernels.length === 0 ? {} : { kernels }),
    }
  })
}

type Served = NonNullable<PeerView['capabilities']>['models'][number]

const isWhole = (m: Served): boolean =>
  m.layers === undefined || (m.layers[0] === 0 && m.totalLayers !== undefined && m.layers[1] === m.totalLayers - 1)

/**
 * A node can take a request for a model when it serves the model whole or coordinates a chain of
 * it (holds stage 0 and the tokenizer); an incomplete chain is refused by the coordinator itself,
 * naming the missing layers.
 */
const isEntryPoint = (m: Served): boolean => isWhole(m) || m.layers![0] === 0

/**
 * This node's live load: the local engines' batcher readings summed (their slots are the sequences
 * they admit; their queues and expected waits are what a new request would meet), plus requests
 * this node coordinates as pipeline chains (running ones in flight, those waiting for a chain slot
 * queued). The decode rate is each engine's capacity at its current concurrency + 1, not its
 * recent throughput: throughput decays while a node idles, and an idle node must not look slow
 * (routing divides by this rate).
 */
export function aggregateLoad (engines: LocalServiceLoad[], chainRequests: number, prefixes: readonly string[] = [], prefillRates: ReadonlyArray<number | undefined> = [], chainWaiting = 0): LoadRecord {
  let queueDepth = chainWaiting
  let inFlight = chainRequests
  let decodeTokPerSec = 0
  let slots = 0
  let expectedWaitMs = 0
  for (const l of engines) {
    queueDepth += l.queueDepth
    inFlight += l.activeSequences
    decodeTokPerSec += l.capacityTokensPerSecond
    slots += l.slots
    expectedWaitMs = Math.max(expectedWaitMs, l.expectedWaitMs)
  }
  return {
    queueDepth, inFlight, decodeTokPerSec, freeKvTokens: 0, expectedWaitMs, slots: Math.max(slots, 1),
    // What the engines keep for prefix reuse (already merged and bounded; absent when nothing).
    ...(prefixes.length > 0 ? { prefixes: [...prefixes] } : {}),
    // What a kept prefix saves here: the slowest measured engine's rate (0 or absent: unknown).
    ...(measuredMin(prefillRates) === undefined ? {} : { prefillTokPerSec: measuredMin(prefillRates)! }),
  }
}

/**
 * How to read a peer's prefix summary for `served`: the scope its local service hashes under (a
 * whole model: manifest hash, layers 0..n-1, float32 KV, as daemon/engine's local service keys
 * them) and the default block size. Chain entries keep no prefixes yet; a peer that does not say
 * its manifest cannot be read.
 */
function measuredMin (rates: ReadonlyArray<number | undefined>): number | undefined {
  const known = rates.filter((r): r is number => r !== undefined && Number.isFinite(r) && r > 0)
  return known.length === 0 ? undefined : Math.min(...known)
}

function peerPrefixes (served: Served, load: LoadRecord | undefined): PrefixHoldings | undefined {
  // A chain's entry point (stage 0) says what its chains keep in the same whole-model scope
  // (pipeline service prefixSummary), so it is read like a whole model's.
  if (!isEntryPoint(served) || served.manifestHash === undefined || served.totalLayers === undefined || served.totalLayers < 1) return undefined
  return {
    scope: prefixScope({ manifestHash: served.manifestHash, layers: [0, served.totalLayers - 1], dtype: 'float32' }),
    blockSize: DEFAULT_BLOCK_SIZE,
    // None listed (nothing kept yet, or no cache): routing may still learn what our requests leave there.
    hashes: load?.prefixes ?? [],
    ...(load?.prefillTokPerSec === undefined ? {} : { prefillTokensPerSecond: load.prefillTokPerSec }),
  }
}

/**
 * Every node that can take a request for `model` (whole or chain entry), this one included.
 * `self.prefixes`: what this node's own engine for the model keeps (its exact scope and block size).
 */
export function replicaCandidates (model: string, self: { peerId: string, serves: boolean, load: LoadRecord, prefixes?: PrefixHoldings }, peers: PeerView[], now: number): Candidate[] {
  const out: Candidate[] = []
  if (self.serves) {
    out.push({
      peerId: self.peerId, local: true, admitted: true, alive: true, wholeModel: true, load: toSnapshot(self.load, now),
      // Even with no hashes: its measured prefill rate stands in for peers that do not say theirs.
      ...(self.prefixes === undefined ? {} : { prefixes: self.prefixes }),
    })
  }
  for (const p of peers) {
    // Only worker certificates execute work for others (their own handlers refuse otherwise).
    if (!p.roles.includes('worker')) continue
    const served = p.capabilities?.models.find(m => m.id === model)
    if (served === undefined) continue
    const prefixes = peerPrefixes(served, p.load)
    out.push({
      peerId: p.peerId,
      local: false,
      admitted: true,
      alive: p.state === 'alive',
      wholeModel: isEntryPoint(served),
      ...(p.load === undefined || p.loadAt === undefined ? {} : { load: toSnapshot(p.load, p.loadAt) }),
      ...(p.rttMs === undefined ? {} : { rttMs: p.rttMs }),
      ...(prefixes === undefined ? {} : { prefixes }),
    })
  }
  return out
}

function toSnapshot (load: LoadRecord, observedAt: number): NonNullable<Candidate['load']> {
  return {
    observedAt,
    queueDepth: load.queueDepth,
    inFlight: load.inFlight,
    slots: load.slots ?? 1,
    tokensPerSecond: load.decodeTokPerSec,
    expectedQueueWaitMs: load.expectedWaitMs,
    ...(load.accepting === undefined ? {} : { accepting: load.accepting }),
    ...(load.fromYou === undefined ? {} : { fromYou: load.fromYou }),
  }
}

/** Stage holders of `model` among peers, for chain formation. */
export function stageHolders (model: string, peers: PeerView[]): StageHolder[] {
  const out: StageHolder[] = []
  for (const p of peers) {
    if (!p.roles.includes('worker')) continue
    for (const m of p.capabilities?.models ?? []) {
      if (m.id !== model || m.layers === undefined || m.manifestHash === undefined) continue
      out.push({
        peerId: p.peerId,
        modelId: m.id,
        manifestHash: m.manifestHash,
        layers: [m.layers[0], m.layers[1]],
        admitted: true,
        alive: p.state === 'alive',
        ...(p.load === undefined || p.loadAt === undefined ? {} : { load: toSnapshot(p.load, p.loadAt) }),
        ...(p.rttMs === undefined ? {} : { rttMs: p.rttMs }),
        ...(m.stepMs === undefined ? {} : { stepMs: m.stepMs }),
        ...(m.activations === undefined ? {} : { activations: [...m.activations] }),
        ...(m.kernels === undefined ? {} : { kernels: [...m.kernels] }),
      })
    }
  }
  return out
}

/** True when alive stages of one manifest cover every layer of the model (a chain can form). */
function chainComplete (model: string, peers: PeerView[]): boolean {
  const byManifest = new Map<string, { ranges: LayerRange[], total: number }>()
  for (const h of stageHolders(model, peers.filter(p => p.state === 'alive'))) {
    const served = peers.find(p => p.peerId === h.peerId)!.capabilities!.models.find(m => m.id === model)!
    const entry = byManifest.get(h.manifestHash) ?? { ranges: [], total: served.totalLayers ?? 0 }
    entry.ranges.push(h.layers)
    byManifest.set(h.manifestHash, entry)
  }
  return [...byManifest.values()].some(e => e.total > 0 && uncovered(e.ranges, e.total).length === 0)
}

/** Models peers can serve right now — whole, replicated or as a complete chain — for /v1/models. */
export function meshModelCards (peers: PeerView[]): ModelCard[] {
  const cards = new Map<string, ModelCard>()
  for (const p of peers) {
    if (p.state !== 'alive' || !p.roles.includes('worker')) continue
    for (const m of p.capabilities?.models ?? []) {
      if (!isWhole(m) && !(isEntryPoint(m) && chainComplete(m.id, peers))) continue
      const card = cards.get(m.id) ?? { id: m.id, created: 0, ownedBy: 'shoal', contextLength: m.maxContextTokens ?? 0, servedBy: [] }
      card.servedBy = [...(card.servedBy ?? []), p.peerId]
      cards.set(m.id, card)
    }
  }
  return [...cards.values()]
}

/**
 * Expert holders of one expert-parallel model (by its shards key) among peers, with the memory
 * they offer: what placeExperts plans over. Only live worker peers (a suspect holder's experts are
 * placed elsewhere; its copies take over for steps already under way).
 */
export function expertHolderNodes (key: string, peers: PeerView[]): Array<{ peerId: string, freeBytes: number }> {
  const out: Array<{ peerId: string, freeBytes: number }> = []
  for (const p of peers) {
    if (p.state !== 'alive' || !p.roles.includes('worker')) continue
    const held = p.capabilities?.experts?.find(e => e.model === key)
    if (held !== undefined) out.push({ peerId: p.peerId, freeBytes: held.budgetBytes })
  }
  return out
}
