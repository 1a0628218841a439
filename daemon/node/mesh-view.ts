/**
 * Maps the mesh's peer table onto the plain data routing decides over, and this node's models onto
 * the capability record it gossips. Pure functions: the daemon gathers, these translate.
 */
import type { Capabilities, LoadRecord, PeerView } from '../mesh/index.ts'
import type { Candidate } from '../routing/index.ts'
import type { ModelCard } from '../service.ts'
import type { ResolvedModel } from './models.ts'

export function servedModels (models: ResolvedModel[]): Capabilities['models'] {
  return models.map(m => {
    const stage = m.manifest.stages[m.stageIndex]!
    return {
      id: m.manifest.modelId,
      manifestHash: m.manifestHash,
      // A whole model carries no layer range (the capability format's convention).
      ...(m.whole ? {} : { layers: [stage.layers[0], stage.layers[1]] as [number, number] }),
      totalLayers: m.manifest.shape.numLayers,
      maxContextTokens: m.manifest.shape.maxPositions,
    }
  })
}

/** Every node that serves `model` whole, this one included. */
export function replicaCandidates (model: string, self: { peerId: string, serves: boolean, load: LoadRecord }, peers: PeerView[], now: number): Candidate[] {
  const out: Candidate[] = []
  if (self.serves) {
    out.push({ peerId: self.peerId, local: true, admitted: true, alive: true, wholeModel: true, load: toSnapshot(self.load, now) })
  }
  for (const p of peers) {
    const served = p.capabilities?.models.find(m => m.id === model)
    if (served === undefined) continue
    const whole = served.layers === undefined || (served.layers[0] === 0 && served.totalLayers !== undefined && served.layers[1] === served.totalLayers - 1)
    out.push({
      peerId: p.peerId,
      local: false,
      admitted: true,
      alive: p.state === 'alive',
      wholeModel: whole,
      ...(p.load === undefined || p.loadAt === undefined ? {} : { load: toSnapshot(p.load, p.loadAt) }),
      ...(p.rttMs === undefined ? {} : { rttMs: p.rttMs }),
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
  }
}

/** Whole models that peers serve, for /v1/models (one card per model id). */
export function meshModelCards (peers: PeerView[]): ModelCard[] {
  const cards = new Map<string, ModelCard>()
  for (const p of peers) {
    if (p.state !== 'alive') continue
    for (const m of p.capabilities?.models ?? []) {
      const whole = m.layers === undefined || (m.layers[0] === 0 && m.totalLayers !== undefined && m.layers[1] === m.totalLayers - 1)
      if (!whole) continue
      const card = cards.get(m.id) ?? { id: m.id, created: 0, ownedBy: 'shoal', contextLength: m.maxContextTokens ?? 0, servedBy: [] }
      card.servedBy = [...(card.servedBy ?? []), p.peerId]
      cards.set(m.id, card)
    }
  }
  return [...cards.values()]
}
