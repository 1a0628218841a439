/**
 * What the dashboard (GET /) shows, as one plain JSON document: this node, the mesh as it sees it
 * (admission, liveness, RTT, load), every model and how it is served (whole, replicas, chains of
 * stages with their holders and missing layers), this node's engine and stage queues, and the
 * recent receipts with their routes, and for mixture-of-experts models staged here which holder
 * holds how many experts of each MoE layer (and what this node holds, as a holder). A pure function over what the daemon gathers, so the page's
 * content is unit-tested without sockets; the ingress only serves and streams it.
 */
import type { LocalServiceLoad } from '../engine/index.ts'
import type { SignedReceipt } from '../ledger/index.ts'
import type { LoadRecord, MeshSnapshot, PeerModel, PeerSnapshot } from '../mesh/index.ts'
import { uncovered } from '../routing/index.ts'

export const DASHBOARD_FORMAT = 'shoal.dashboard/1'

export interface DashboardNode {
  peerId: string
  name?: string
  self: boolean
  admitted: boolean
  /** Why not admitted. */
  reason?: string
  detail?: string
  state: 'alive' | 'suspect'
  roles?: string[]
  rttMs?: number
  ingress?: string
  engine?: string
  device?: string
  addrs?: string[]
  /** Model labels: `id` for a whole model, `id@A-B` for a stage. */
  models: string[]
  load?: { inFlight: number, queueDepth: number, slots?: number, expectedWaitMs: number, decodeTokPerSec: number, accepting?: boolean }
  certificateExpiresAt?: string
  certificateExpiresSoon?: boolean
}

export interface DashboardHolder { peerId: string, name?: string, self: boolean, state: 'alive' | 'suspect' }

export interface DashboardChain {
  manifestHash?: string
  totalLayers?: number
  stages: Array<{ layers: [number, number], holders: DashboardHolder[] }>
  /** Layer ranges no holder serves. */
  missing: Array<[number, number]>
  complete: boolean
}

export interface DashboardModel {
  id: string
  /** 'whole' (one node), 'replicas' (several), 'chain', 'chain (incomplete)', or a mix joined by ' + '. */
  servedAs: string
  whole: DashboardHolder[]
  chains: DashboardChain[]
}

export interface DashboardEngineLoad {
  model: string
  /** The layers when this is a stage engine. */
  layers?: [number, number]
  slots?: number
  activeSequences?: number
  queueDepth: number
  inFlight: number
  expectedWaitMs: number
  decodeTokensPerSecond: number
  /** Requests a stage holds KV for. */
  served?: number
}

export interface DashboardRequest {
  id: string
  index: number
  timestamp: number
  model: string
  route: Array<{ peerId: string, name?: string, layers?: [number, number] }>
  promptTokens: number
  completionTokens: number
  firstTokenMs: number | null
  totalMs: number
  finishReason: string
}

/** An expert plan as the daemon's experts part reports it (/v1/mesh `experts.plans`). */
export interface ExpertPlanInput {
  model: string
  key: string
  layers: Array<{ layer: number, holders: Record<string, number[]> }>
  nodes: Array<{ peerId: string }>
  excluded: string[]
  steps: number
  bytesOut: number
  bytesIn: number
}

/** What this node holds as an expert holder (/v1/mesh `experts.holding`). */
export interface ExpertHoldingInput {
  model: string
  key: string
  budgetBytes: number
  resident: Array<{ layer: number, experts: number[] }>
  steps: number
}

/** A staged MoE model's plan, compactly: holders × expert counts per MoE layer. */
export interface DashboardExpertPlan {
  model: string
  key: string
  /** The MoE layers, ascending (the columns). */
  layers: number[]
  /** One row per holder: how many experts of each layer it holds (ids are in /v1/mesh). */
  holders: Array<DashboardHolder & { counts: number[], total: number, excluded: boolean }>
  /** The fewest copies any expert of each layer has: 1 means a holder's death re-places it. */
  minCopies: number[]
  steps: number
  bytesOut: number
  bytesIn: number
}

export interface DashboardState {
  format: typeof DASHBOARD_FORMAT
  at: number
  /** 'serve': one machine, no mesh; 'node': a mesh member. */
  mode: 'serve' | 'node'
  self: DashboardNode & { apiUrl?: string, software?: string, revocationListNumber?: number }
  peers: DashboardNode[]
  models: DashboardModel[]
  load: { engines: DashboardEngineLoad[], chainRequests: number, node?: DashboardNode['load'] }
  requests: DashboardRequest[]
  receiptCount: number
  /** Expert plans of the MoE models staged here, and what this node holds as an expert holder. */
  experts: { plans: DashboardExpertPlan[], holding?: { model: string, key: string, budgetBytes: number, counts: Array<{ layer: number, experts: number }>, total: number, steps: number } }
}

export interface DashboardInput {
  now: number
  self: { peerId: string, name?: string, engine?: string, device?: string, apiUrl?: string, software?: string }
  /** This node's models as it declares them (whole: no layers). */
  models: PeerModel[]
  mesh?: MeshSnapshot
  engines: Array<{ model: string, load: LocalServiceLoad }>
  stages: Array<{ model: string, layers: [number, number], load?: DashboardEngineLoad, served: number }>
  chainRequests: number
  nodeLoad?: LoadRecord
  receipts: SignedReceipt[]
  receiptCount: number
  /** Names for peer ids that are this node's own (the stages of a local chain run under throwaway ids). */
  aliases?: Record<string, string>
  experts?: { plans: ExpertPlanInput[], holding?: ExpertHoldingInput }
}

const label = (m: PeerModel): string => m.layers === undefined || isWhole(m) ? m.id : `${m.id}@${m.layers[0]}-${m.layers[1]}`

function isWhole (m: PeerModel): boolean {
  return m.layers === undefined || (m.layers[0] === 0 && m.totalLayers !== undefined && m.layers[1] === m.totalLayers - 1)
}

function loadView (l: LoadRecord | undefined): DashboardNode['load'] {
  if (l === undefined) return undefined
  return {
    inFlight: l.inFlight,
    queueDepth: l.queueDepth,
    ...(l.slots === undefined ? {} : { slots: l.slots }),
    expectedWaitMs: Math.round(l.expectedWaitMs),
    decodeTokPerSec: Math.round(l.decodeTokPerSec * 10) / 10,
    ...(l.accepting === undefined ? {} : { accepting: l.accepting }),
  }
}

function peerNode (p: PeerSnapshot): DashboardNode {
  const load = loadView(p.load)
  return {
    peerId: p.peerId,
    ...(p.name === undefined ? {} : { name: p.name }),
    self: false,
    admitted: p.admitted,
    ...(p.reason === undefined ? {} : { reason: p.reason }),
    ...(p.detail === undefined ? {} : { detail: p.detail }),
    state: p.state,
    ...(p.roles === undefined ? {} : { roles: p.roles }),
    ...(p.rttMs === undefined ? {} : { rttMs: Math.round(p.rttMs * 10) / 10 }),
    ...(p.ingress === undefined ? {} : { ingress: p.ingress }),
    ...(p.engine === undefined ? {} : { engine: p.engine }),
    ...(p.device === undefined ? {} : { device: p.device }),
    ...(p.addrs === undefined ? {} : { addrs: p.addrs }),
    models: p.models.map(label),
    ...(load === undefined ? {} : { load }),
    ...(p.certificateExpiresAt === undefined ? {} : { certificateExpiresAt: p.certificateExpiresAt, certificateExpiresSoon: p.certificateExpiresSoon === true }),
  }
}

/** Every model this node or an admitted peer declares, and how the mesh can serve it. */
export function modelsServed (holders: Array<{ node: DashboardHolder, models: PeerModel[] }>): DashboardModel[] {
  const byId = new Map<string, { whole: DashboardHolder[], chains: Map<string, { total?: number, stages: Map<string, DashboardChain['stages'][number]> }> }>()
  for (const { node, models } of holders) {
    for (const m of models) {
      const entry = byId.get(m.id) ?? { whole: [] as DashboardHolder[], chains: new Map() }
      byId.set(m.id, entry)
      if (isWhole(m)) {
        entry.whole.push(node)
        continue
      }
      const key = m.manifestHash ?? ''
      const chain = entry.chains.get(key) ?? { ...(m.totalLayers === undefined ? {} : { total: m.totalLayers }), stages: new Map() }
      entry.chains.set(key, chain)
      const layers: [number, number] = [m.layers![0], m.layers![1]]
      const stage = chain.stages.get(layers.join('-')) ?? { layers, holders: [] }
      stage.holders.push(node)
      chain.stages.set(layers.join('-'), stage)
    }
  }
  const out: DashboardModel[] = []
  for (const [id, entry] of [...byId.entries()].sort(([a], [b]) => a.localeCompare(b))) {
    const chains: DashboardChain[] = [...entry.chains.entries()].map(([hash, c]) => {
      const stages = [...c.stages.values()].sort((a, b) => a.layers[0] - b.layers[0] || a.layers[1] - b.layers[1])
      // Only live holders make a chain that can run now.
      const live = stages.filter(s => s.holders.some(h => h.state === 'alive')).map(s => s.layers)
      const missing = c.total === undefined ? [] : uncovered(live, c.total).map(([a, b]): [number, number] => [a, b])
      return {
        ...(hash === '' ? {} : { manifestHash: hash }),
        ...(c.total === undefined ? {} : { totalLayers: c.total }),
        stages,
        missing,
        complete: c.total !== undefined && missing.length === 0,
      }
    })
    const kinds: string[] = []
    if (entry.whole.length === 1) kinds.push('whole')
    if (entry.whole.length > 1) kinds.push('replicas')
    for (const c of chains) kinds.push(c.complete ? 'chain' : 'chain (incomplete)')
    out.push({ id, servedAs: [...new Set(kinds)].join(' + '), whole: entry.whole, chains })
  }
  return out
}

function request (r: SignedReceipt, names: Map<string, string>): DashboardRequest {
  const b = r.body
  return {
    id: b.id,
    index: b.index,
    timestamp: b.timestamp,
    model: b.model.id,
    route: b.route.map(h => ({
      peerId: h.peerId,
      ...(names.has(h.peerId) ? { name: names.get(h.peerId)! } : {}),
      ...(h.layers === undefined ? {} : { layers: [h.layers[0], h.layers[1]] as [number, number] }),
    })),
    promptTokens: b.usage.promptTokens,
    completionTokens: b.usage.completionTokens,
    firstTokenMs: b.timing.firstTokenMs,
    totalMs: b.timing.totalMs,
    finishReason: b.finishReason,
  }
}

/** Holders × expert counts per layer, named and with their liveness as the mesh sees them. */
export function expertPlanView (plan: ExpertPlanInput, holderOf: (peerId: string) => DashboardHolder): DashboardExpertPlan {
  const layers = [...plan.layers].sort((a, b) => a.layer - b.layer)
  const excluded = new Set(plan.excluded)
  const peers = [...new Set([...plan.nodes.map(n => n.peerId), ...layers.flatMap(l => Object.keys(l.holders))])]
  return {
    model: plan.model,
    key: plan.key,
    layers: layers.map(l => l.layer),
    holders: peers.map(peerId => {
      const counts = layers.map(l => l.holders[peerId]?.length ?? 0)
      return { ...holderOf(peerId), counts, total: counts.reduce((a, b) => a + b, 0), excluded: excluded.has(peerId) }
    }),
    minCopies: layers.map(l => {
      const copies = new Map<number, number>()
      for (const es of Object.values(l.holders)) for (const e of es) copies.set(e, (copies.get(e) ?? 0) + 1)
      return copies.size === 0 ? 0 : Math.min(...copies.values())
    }),
    steps: plan.steps,
    bytesOut: plan.bytesOut,
    bytesIn: plan.bytesIn,
  }
}

export function dashboardState (input: DashboardInput): DashboardState {
  const mesh = input.mesh
  const selfName = input.self.name ?? mesh?.self.name
  const nodeLoad = loadView(input.nodeLoad ?? mesh?.self.load)
  const self: DashboardState['self'] = {
    peerId: input.self.peerId,
    ...(selfName === undefined ? {} : { name: selfName }),
    self: true,
    admitted: true,
    state: 'alive',
    ...(mesh === undefined ? {} : { roles: mesh.self.roles, addrs: mesh.self.addrs, certificateExpiresAt: mesh.self.certificateExpiresAt, certificateExpiresSoon: mesh.self.certificateExpiresSoon }),
    ...(input.self.engine === undefined ? {} : { engine: input.self.engine }),
    ...(input.self.device === undefined ? {} : { device: input.self.device }),
    ...(input.self.apiUrl === undefined ? {} : { apiUrl: input.self.apiUrl, ingress: input.self.apiUrl }),
    ...(input.self.software === undefined ? {} : { software: input.self.software }),
    ...(mesh?.self.revocationListNumber === undefined ? {} : { revocationListNumber: mesh.self.revocationListNumber }),
    models: input.models.map(label),
    ...(nodeLoad === undefined ? {} : { load: nodeLoad }),
  }
  const peers = (mesh?.peers ?? []).map(peerNode)
    // Admitted first, then by name: a stable order the page does not reshuffle on every update.
    .sort((a, b) => Number(b.admitted) - Number(a.admitted) || (a.name ?? a.peerId).localeCompare(b.name ?? b.peerId))
  const holderOf = (n: DashboardNode): DashboardHolder => ({ peerId: n.peerId, ...(n.name === undefined ? {} : { name: n.name }), self: n.self, state: n.state })
  const models = modelsServed([
    { node: holderOf(self), models: input.models },
    ...(mesh?.peers ?? []).filter(p => p.admitted).map(p => ({ node: holderOf(peerNode(p)), models: p.models })),
  ])
  const names = new Map<string, string>([[self.peerId, self.name ?? 'this node'], ...Object.entries(input.aliases ?? {}), ...peers.filter(p => p.name !== undefined).map(p => [p.peerId, p.name!] as [string, string])])
  const engines: DashboardEngineLoad[] = [
    ...input.engines.map(e => ({
      model: e.model,
      slots: e.load.slots,
      activeSequences: e.load.activeSequences,
      queueDepth: e.load.queueDepth,
      inFlight: e.load.inFlight,
      expectedWaitMs: Math.round(e.load.expectedWaitMs),
      decodeTokensPerSecond: Math.round(e.load.decodeTokensPerSecond * 10) / 10,
    })),
    ...input.stages.map(s => ({
      queueDepth: 0,
      inFlight: 0,
      expectedWaitMs: 0,
      decodeTokensPerSecond: 0,
      ...s.load,
      model: s.model,
      layers: s.layers,
      served: s.served,
    })),
  ]
  const byPeer = new Map<string, DashboardHolder>([[self.peerId, holderOf(self)], ...peers.map(p => [p.peerId, holderOf(p)] as [string, DashboardHolder])])
  // A holder the mesh no longer lists (gone since the plan was made) shows as suspect.
  const expertHolder = (peerId: string): DashboardHolder => byPeer.get(peerId) ?? { peerId, ...(names.has(peerId) ? { name: names.get(peerId)! } : {}), self: false, state: 'suspect' }
  const holding = input.experts?.holding
  const experts: DashboardState['experts'] = {
    plans: (input.experts?.plans ?? []).map(p => expertPlanView(p, expertHolder)),
    ...(holding === undefined
      ? {}
      : {
          holding: {
            model: holding.model,
            key: holding.key,
            budgetBytes: holding.budgetBytes,
            counts: [...holding.resident].sort((a, b) => a.layer - b.layer).map(l => ({ layer: l.layer, experts: l.experts.length })),
            total: holding.resident.reduce((n, l) => n + l.experts.length, 0),
            steps: holding.steps,
          },
        }),
  }
  return {
    format: DASHBOARD_FORMAT,
    at: input.now,
    mode: mesh === undefined ? 'serve' : 'node',
    self,
    peers,
    models,
    load: { engines, chainRequests: input.chainRequests, ...(nodeLoad === undefined ? {} : { node: nodeLoad }) },
    // Newest first: what an operator looks for.
    requests: input.receipts.map(r => request(r, names)).reverse(),
    receiptCount: input.receiptCount,
    experts,
  }
}
