/**
 * Gathers what the dashboard shows from the daemon's running parts (mesh, engines, stages, ledger)
 * and hands it to the pure `dashboardState`. The ingress serves and streams the result.
 */
import type { DashboardSource } from '../ingress/index.ts'
import type { LocalService } from '../engine/index.ts'
import type { Ledger } from '../ledger/index.ts'
import type { LoadRecord, Mesh, PeerModel } from '../mesh/index.ts'
import type { PipelineStage } from '../pipeline/index.ts'
import { dashboardState } from './dashboard-view.ts'
import type { DashboardInput } from './dashboard-view.ts'
import type { ExpertsView } from './experts.ts'

/** Receipts the page lists. */
const RECENT = 20

export interface DashboardParts {
  self: () => DashboardInput['self']
  models: () => PeerModel[]
  mesh: () => Mesh | undefined
  locals: () => readonly LocalService[]
  stages: () => readonly PipelineStage[]
  chainRequests: () => number
  nodeLoad: () => LoadRecord
  ledger: () => Ledger | undefined
  /** Expert plans of the MoE models staged here and the experts held here (absent: none). */
  experts?: () => ExpertsView | undefined
}

export function createDashboardSource (parts: DashboardParts): DashboardSource {
  return {
    async state () {
      const ledger = parts.ledger()
      return dashboardState({
        now: Date.now(),
        self: parts.self(),
        models: parts.models(),
        ...(parts.mesh() === undefined ? {} : { mesh: parts.mesh()!.snapshot() }),
        engines: parts.locals().map(s => ({ model: s.models()[0]?.id ?? '?', load: s.load() })),
        stages: parts.stages().map(s => {
          const served = s.served()
          const l = s.load()
          return {
            model: served.id,
            layers: served.layers,
            served: s.node.stats().served,
            ...(l === undefined ? {} : { load: { model: served.id, queueDepth: l.queueDepth, inFlight: l.inFlight, expectedWaitMs: Math.round(l.expectedWaitMs), decodeTokensPerSecond: Math.round(l.decodeTokensPerSecond * 10) / 10 } }),
          }
        }),
        chainRequests: parts.chainRequests(),
        nodeLoad: parts.nodeLoad(),
        receipts: ledger === undefined ? [] : await ledger.tail(RECENT),
        receiptCount: ledger?.size ?? 0,
        aliases: aliasesOf(parts.self(), parts.stages()),
        ...expertsOf(parts.experts?.()),
      })
    },
    async verify (id) {
      return await parts.ledger()?.verifyOne(id)
    },
    onChange (listener) {
      const mesh = parts.mesh()
      if (mesh === undefined) return () => {}
      // Load arrives several times a second per peer; the page's periodic refresh shows it.
      return mesh.onChange(change => { if (change.kind !== 'load') listener() })
    },
  }
}

function expertsOf (view: ExpertsView | undefined): Pick<DashboardInput, 'experts'> {
  if (view === undefined) return {}
  return { experts: { plans: view.plans, ...(view.holding === undefined ? {} : { holding: view.holding }) } }
}

/** A local chain's stages run under their own throwaway peer ids: name them after this node. */
function aliasesOf (self: DashboardInput['self'], stages: readonly PipelineStage[]): Record<string, string> {
  const out: Record<string, string> = {}
  for (const s of stages) if (s.node.peerId !== self.peerId) out[s.node.peerId] = self.name ?? 'this node'
  return out
}
