/**
 * The InferenceService the ingress talks to: picks a replica with chooseReplica, runs the request
 * on the local engine or forwards it to a peer, and retries once, invisibly, on another replica
 * when the first fails before `start` in a retryable way. After `start` a failure ends the stream
 * with the error (the ingress turns it into an error event).
 */
import type { GenerateEvent, GenerateRequest, InferenceService, ModelCard } from '../service.ts'
import { createAffinityTable } from './affinity.ts'
import { chooseReplica } from './decision.ts'
import type { Candidate, RoutingPolicy } from './decision.ts'
import { joiningReason } from './joining.ts'
import { isRetryable, ModelNotFoundError, NoEligibleNodeError, OverloadedError } from './errors.ts'
import { withRouteHop } from './server.ts'

export interface RoutedServiceInit {
  /** This node's peer id: names the local engine in routes. */
  localPeerId?: string
  policy?: Partial<RoutingPolicy>
  /** Retry once on another replica after a retryable failure before start (default true). */
  retry?: boolean
  /** Injected for deterministic tests; default Math.random / Date.now. */
  random?: () => number
  now?: () => number
  affinityEntries?: number
  /**
   * For this long after creation, a model no node is known to serve is answered 503 (not known
   * here yet), not 404: a node that just joined has not heard every peer's capabilities (0: off).
   */
  joinWindowMs?: number
}

export interface RoutedServiceComponents {
  /** The local engine, when this node serves models itself. */
  local?: InferenceService
  /** What the mesh knows about every node that claims `model` (the local node included, `local: true`). */
  candidates(model: string): Candidate[]
  /** Runs the request on a peer (forwardGenerate over the mesh's stream opener). */
  forward(peerId: string, request: GenerateRequest, signal: AbortSignal): AsyncIterable<GenerateEvent>
  /** Models peers can serve (whole, replicated or as complete chains). */
  meshModels?(): ModelCard[]
}

export interface RoutedService extends InferenceService {
  /** Requests this node has dispatched and not yet finished, per peer. */
  inFlight(): Record<string, number>
}

const MAX_FINISHED_PER_PEER = 256

export function createRoutedService (init: RoutedServiceInit, components: RoutedServiceComponents): RoutedService {
  const random = init.random ?? Math.random
  const now = init.now ?? Date.now
  const retry = init.retry ?? true
  const affinity = createAffinityTable({ maxEntries: init.affinityEntries })
  const createdAt = now()
  let roundRobin = 0
  /** Dispatch times of our own unfinished requests per peer: load the peer has not reported yet. */
  const dispatched = new Map<string, number[]>()
  /** Our own requests that finished recently, per peer: a load report may still count them. */
  const finished = new Map<string, Array<{ at: number, end: number }>>()

  const track = (peerId: string, at: number): () => void => {
    const list = dispatched.get(peerId) ?? []
    list.push(at)
    dispatched.set(peerId, list)
    return () => {
      const i = list.indexOf(at)
      if (i >= 0) list.splice(i, 1)
      if (list.length === 0 && dispatched.get(peerId) === list) dispatched.delete(peerId)
      const done = finished.get(peerId) ?? []
      done.push({ at, end: now() })
      // Bounded: only reports newer than the oldest kept finish matter, and reports come often.
      if (done.length > MAX_FINISHED_PER_PEER) done.splice(0, done.length - MAX_FINISHED_PER_PEER)
      finished.set(peerId, done)
    }
  }

  /**
   * The peer's last load report with our own share made current, so a burst does not all land on
   * one node and a freed slot does not look full until the next report. When the peer says how
   * many of its requests are ours, that share is swapped for our exact count. Otherwise (an older
   * peer) it is guessed from times: our dispatches after the report are added and our requests it
   * counted that have finished since are taken off.
   */
  const withOwnLoad = (c: Candidate): Candidate => {
    if (c.load === undefined) return c
    if (c.load.fromYou !== undefined) {
      const inFlight = Math.max(0, c.load.inFlight - c.load.fromYou) + (dispatched.get(c.peerId)?.length ?? 0)
      return inFlight === c.load.inFlight ? c : { ...c, load: { ...c.load, inFlight } }
    }
    const observedAt = c.load.observedAt
    const unseen = (dispatched.get(c.peerId) ?? []).filter(t => t > observedAt).length
    const gone = (finished.get(c.peerId) ?? []).filter(f => f.at <= observedAt && f.end > observedAt).length
    if (unseen === 0 && gone === 0) return c
    return { ...c, load: { ...c.load, inFlight: Math.max(0, c.load.inFlight + unseen - gone) } }
  }

  async function * generate (request: GenerateRequest, signal: AbortSignal): AsyncGenerator<GenerateEvent, void, undefined> {
    const tried: string[] = []
    const preferred = affinity.lookup(request)
    let firstError: unknown
    for (let attempt = 0; ; attempt++) {
      const all = components.candidates(request.model)
      // On the retry the failed replica may already be gone from the mesh: report what failed, not 404.
      if (all.length === 0) {
        if (firstError !== undefined) throw firstError
        const joining = joiningReason(now() - createdAt, init.joinWindowMs ?? 0)
        if (joining !== undefined) throw new NoEligibleNodeError(`no node serving model "${request.model}" is known yet: ${joining}`)
        throw new ModelNotFoundError(request.model)
      }
      const candidates = all.filter(c => !c.local || components.local !== undefined).map(withOwnLoad)
      const decision = chooseReplica(candidates, {
        now: now(),
        random,
        roundRobin: roundRobin++,
        expectedTokens: request.maxTokens,
        deadline: request.deadline,
        affinity: preferred,
        exclude: tried,
        policy: init.policy,
      })
      if (decision.kind !== 'node') {
        // On the retry, the first failure says more than "nobody else".
        if (firstError !== undefined) throw firstError
        throw decision.kind === 'overloaded' ? new OverloadedError(decision.reason) : new NoEligibleNodeError(decision.reason)
      }
      const peerId = decision.peerId
      tried.push(peerId)
      const local = decision.local ? components.local : undefined
      const untrack = track(peerId, now())
      let started = false
      try {
        const source = local !== undefined ? local.generate(request, signal) : components.forward(peerId, request, signal)
        for await (const ev of source) {
          if (ev.type === 'start') {
            started = true
            affinity.record(request, peerId)
            yield local !== undefined && init.localPeerId !== undefined ? withRouteHop(ev, init.localPeerId) : ev
          } else {
            yield ev
          }
        }
        return
      } catch (err) {
        if (started || !retry || attempt >= 1 || signal.aborted || !isRetryable(err)) throw err
        firstError = err
      } finally {
        untrack()
      }
    }
  }

  return {
    models () {
      const byId = new Map<string, ModelCard>()
      for (const card of components.meshModels?.() ?? []) byId.set(card.id, { ...card })
      for (const card of components.local?.models() ?? []) {
        const mesh = byId.get(card.id)
        const servedBy = [...new Set([...(card.servedBy ?? [init.localPeerId ?? 'local']), ...(mesh?.servedBy ?? [])])]
        byId.set(card.id, { ...card, servedBy })
      }
      return [...byId.values()].sort((a, b) => a.id < b.id ? -1 : a.id > b.id ? 1 : 0)
    },
    generate,
    inFlight () {
      return Object.fromEntries([...dispatched].map(([peer, list]) => [peer, list.length]))
    },
  }
}
