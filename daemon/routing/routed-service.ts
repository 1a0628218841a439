/**
 * The InferenceService the ingress talks to: picks a replica with chooseReplica, runs the request
 * on the local engine or forwards it to a peer, and retries once, invisibly, on another replica
 * when the first fails before `start` in a retryable way. After `start` a failure ends the stream
 * with the error (the ingress turns it into an error event).
 *
 * Prefix-aware routing: when some candidate's load reply lists cached prefix blocks, the prompt's
 * token ids (the local tokenizer's, or the request's own ids) are hashed in each holder's scope and
 * planPrefixRoute decides whether a holder's saved prefill outweighs its wait; its answer goes to
 * chooseReplica as the affinity (with the saved time as slack). When the chosen node lacks a
 * prefix another peer holds, the forwarded request carries that peer as `prefixHolder`. A prompt
 * our own request left on a peer counts as held there at once (from the ids its `start` returned),
 * until the peer's next load report, so a follow-up sent the moment a turn ends finds it too.
 */
import type { Registry } from 'prom-client'
import type { GenerateEvent, GenerateRequest, InferenceService, ModelCard } from '../service.ts'
import { createAffinityTable } from './affinity.ts'
import { chooseReplica, isSoleServer } from './decision.ts'
import type { Candidate, RoutingPolicy } from './decision.ts'
import { joiningReason } from './joining.ts'
import { createRoutingMetrics } from './metrics.ts'
import { keptPromptHash, planPrefixRoute, prefixHolderHint, withLearnedPrefixes } from './prefix-route.ts'
import type { LearnedPrefix, PrefixRoute, PrefixRoutePolicy } from './prefix-route.ts'
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
  /** Weigh candidates' cached prefixes (default true); false routes as if no node kept any. */
  prefixRouting?: boolean
  prefixPolicy?: Partial<PrefixRoutePolicy>
  /** Where the prefix-routing counter goes (this node's /metrics). */
  metrics?: Registry
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
  /**
   * The prompt's token ids as the model's tokenizer gives them (the local engine's), for hashing
   * against candidates' prefix summaries; undefined when this node cannot tokenize for the model.
   * Not called for prompts given as token ids.
   */
  promptTokens?(request: GenerateRequest, signal: AbortSignal): Promise<number[] | undefined>
}

export interface RoutedService extends InferenceService {
  /** Requests this node has dispatched and not yet finished, per peer. */
  inFlight(): Record<string, number>
}

const MAX_FINISHED_PER_PEER = 256
/** Prompts of ours remembered per peer until its load reports catch up. */
const MAX_LEARNED_PER_PEER = 64
/** How long after a request ends its prompt may still be missing from the peer's reports (keeping it, then the next poll). */
const LEARNED_GRACE_MS = 1_500

export function createRoutedService (init: RoutedServiceInit, components: RoutedServiceComponents): RoutedService {
  const random = init.random ?? Math.random
  const now = init.now ?? Date.now
  const retry = init.retry ?? true
  const affinity = createAffinityTable({ maxEntries: init.affinityEntries })
  const createdAt = now()
  const prefixRouting = init.prefixRouting ?? true
  /** Prompts our requests left on peers, newer than the peers' last reports (withLearnedPrefixes). */
  const learned = new Map<string, LearnedPrefix[]>()
  const withLearned = (c: Candidate): Candidate => {
    const list = learned.get(c.peerId)
    if (list === undefined) return c
    const { candidate, current } = withLearnedPrefixes(c, list, LEARNED_GRACE_MS)
    if (current.length === 0) learned.delete(c.peerId)
    else if (current.length !== list.length) learned.set(c.peerId, current)
    return candidate
  }
  const learn = (c: Candidate | undefined, promptIds: number[]): void => {
    if (c === undefined || c.local || c.prefixes === undefined) return
    const hash = keptPromptHash(c.prefixes, promptIds)
    if (hash === undefined) return
    const list = (learned.get(c.peerId) ?? []).filter(l => l.hash !== hash)
    list.push({ hash, at: now() })
    if (list.length > MAX_LEARNED_PER_PEER) list.splice(0, list.length - MAX_LEARNED_PER_PEER)
    learned.set(c.peerId, list)
  }
  const metrics = createRoutingMetrics(init.metrics)
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

  /**
   * The prompt's token ids for prefix routing: the request's own, else the local tokenizer's. A
   * failure here is not the request's: the node that runs it tokenizes again and reports it.
   */
  const promptIdsOf = async (request: GenerateRequest, signal: AbortSignal): Promise<number[] | undefined> => {
    if (request.prompt.kind === 'tokens') return request.prompt.ids
    try {
      return await components.promptTokens?.(request, signal)
    } catch {
      return undefined
    }
  }

  async function * generate (request: GenerateRequest, signal: AbortSignal): AsyncGenerator<GenerateEvent, void, undefined> {
    const tried: string[] = []
    const preferred = affinity.lookup(request)
    let firstError: unknown
    /** Tokenized at most once, and only when some candidate keeps prefixes (null: not yet). */
    let promptIds: number[] | undefined | null = null
    for (let attempt = 0; ; attempt++) {
      const all = components.candidates(request.model)
      // On the retry the failed replica may already be gone from the mesh: report what failed, not 404.
      if (all.length === 0) {
        if (firstError !== undefined) throw firstError
        const joining = joiningReason(now() - createdAt, init.joinWindowMs ?? 0)
        if (joining !== undefined) throw new NoEligibleNodeError(`no node serving model "${request.model}" is known yet: ${joining}`)
        throw new ModelNotFoundError(request.model)
      }
      const candidates = all.filter(c => !c.local || components.local !== undefined).map(withOwnLoad).map(c => prefixRouting ? withLearned(c) : c)
      let prefix: PrefixRoute | undefined
      if (prefixRouting && candidates.some(c => (c.prefixes?.hashes.length ?? 0) > 0)) {
        if (promptIds === null) promptIds = await promptIdsOf(request, signal)
        if (promptIds !== undefined) {
          prefix = planPrefixRoute(candidates, promptIds, {
            now: now(), expectedTokens: request.maxTokens, exclude: tried, policy: init.policy, prefixPolicy: init.prefixPolicy,
          })
        }
      }
      const holder = prefix?.preference
      const decision = chooseReplica(candidates, {
        now: now(),
        random,
        roundRobin: roundRobin++,
        expectedTokens: request.maxTokens,
        deadline: request.deadline,
        // A holder worth its wait outranks the conversation memory (it knows where the KV is now).
        affinity: holder?.peerId ?? preferred,
        exclude: tried,
        policy: holder === undefined ? init.policy : { ...init.policy, ...holder.policy },
      })
      if (decision.kind !== 'node') {
        // On the retry, the first failure says more than "nobody else".
        if (firstError !== undefined) throw firstError
        throw decision.kind === 'overloaded' ? new OverloadedError(decision.reason) : new NoEligibleNodeError(decision.reason)
      }
      const peerId = decision.peerId
      tried.push(peerId)
      const hint = prefix === undefined ? undefined : prefixHolderHint(prefix, peerId)
      if (prefix !== undefined) {
        metrics.prefixRoutes.inc({ outcome: (prefix.cached.get(peerId) ?? 0) > 0 ? 'holder' : hint !== undefined ? 'elsewhere' : 'none' })
      }
      const sole = isSoleServer(candidates, tried)
      const sent = hint === undefined && !sole ? request : { ...request, ...(hint === undefined ? {} : { prefixHolder: hint }), ...(sole ? { soleServer: true as const } : {}) }
      const local = decision.local ? components.local : undefined
      const untrack = track(peerId, now())
      let started = false
      let startedIds: number[] | undefined
      try {
        const source = local !== undefined ? local.generate(sent, signal) : components.forward(peerId, sent, signal)
        for await (const ev of source) {
          if (ev.type === 'start') {
            started = true
            startedIds = ev.promptTokenIds
            affinity.record(request, peerId)
            yield local !== undefined && init.localPeerId !== undefined ? withRouteHop(ev, init.localPeerId) : ev
          } else {
            // Before the end goes out: a follow-up may be sent the moment the client sees it.
            if (ev.type === 'end' && prefixRouting && startedIds !== undefined) learn(candidates.find(c => c.peerId === peerId), startedIds)
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
