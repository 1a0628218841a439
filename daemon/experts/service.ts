/**
 * The InferenceService of a mixture-of-experts model whose experts live on holder nodes: this
 * node (the stage) holds the expert-parallel shards' embedding, attention + router halves of
 * every layer, dense layers and head, and runs each MoE layer's experts through runExpertStep
 * on the holders the mesh gossips (ExpertServiceComponents.holders).
 *
 * Steps of concurrent requests meet in waves: while a wave runs, new steps queue, and the next
 * wave, once every sequence holding a slot has queued its step (or gatherMs has passed), takes
 * them all (up to maxSequences) through the forward pass (forward.ts): each sequence's
 * attention at batch 1 over its own KV (so its logits do not depend on the company it keeps), each
 * MoE layer's rows of all the wave's sequences to the holders as one step: one frame per holder
 * and one expert call per expert for the whole wave.
 *
 * Admission as a whole model's service: maxSequences sequences at once; a request that finds them
 * busy waits for a slot while decideAdmission's expected wait (the measured full-wave time × the
 * tokens ahead) is within budgetMs, and only beyond that, or past maxWaiting, gets 429 with a
 * retry estimate, so a burst of 64 streams queues instead of 56 of them being refused.
 *
 * Placement: placeExperts over the holders' gossiped memory, every expert getting a second copy
 * where that memory allows (hottest first, by the rows this node has routed so far). The plan is
 * rebuilt when the set of live holders changes. A holder that fails mid-step is excluded and its
 * copies take over (runExpertStep); when an expert has no live copy left the layer is re-placed
 * over the surviving holders (who load what they are given on first use) and the step retried,
 * at most twice; a model the survivors cannot hold fails the request with a typed error
 * (SHOAL_ERR_EXPERTS_UNPLACEABLE, 503) — never a hang: every expert step is bounded by
 * stepTimeoutMs.
 *
 * Receipts: every wave's rows go out with the request each belongs to (request spans), so each
 * holder keeps per-request hashes and counts; when a request ends the stage sends `finish` to
 * every holder that answered rows of it and waits at most PART_WAIT_MS (as the pipeline does)
 * for their signed parts, which ride the `end` event's receiptParts into the ingress's receipt.
 * The stage hashes what it exchanged with each holder the same way, and leaves out a part whose
 * hashes or row counts differ (stats().partsRefused): a receipt names only work the stage saw.
 * A request that fails or is cancelled finishes with `sign: false` (the holders just forget it).
 * Holders that answered rows in any attempt of a step (one re-dispatched or re-placed after
 * another holder failed) are asked too: they did that work.
 */
import { createHash, type Hash } from 'node:crypto'
import { performance } from 'node:perf_hooks'
import type { ShardManifest } from '../../shards/index.ts'
import {
  abortReason, admitPrompt, createRng, createSlots, endConditions, generateSequence, nextPick, ownWaitBudget, pickToken, requestScope,
  type TokenPick, type TokenSource,
} from '../engine/index.ts'
import { errorCodeOf, ModelNotFoundError, OverloadedError, ShoalError } from '../errors.ts'
import type { ReceiptPartBody } from '../ledger/index.ts'
import type { GenerateEvent, GenerateRequest, InferenceService, ModelCard } from '../service.ts'
import { loadTextCodec, type TextCodec } from '../text/index.ts'
import { ExpertsUnplaceableError } from './errors.ts'
import { createExpertForward, type ExpertSequence } from './forward.ts'
import { placeExperts, type ExpertPlan, type PlacementNode } from './placement.ts'
import type { ExpertShards } from './shards-dir.ts'
import { runExpertStep, type ExpertLink, type ExpertStepInput } from './step.ts'
import { decodePayload, encodePayloadParts, type RequestSpan } from './wire.ts'

/** How long the end of a request waits for the holders' receipt parts (as the pipeline's coordinator). */
const PART_WAIT_MS = 2_000

export interface ExpertServiceInit {
  shards: ExpertShards
  /** This node's peer id (the request's route). */
  nodeId: string
  /**
   * Sequences in flight at once (default 8); more wait for a slot while the expected wait is
   * within `budgetMs` (decideAdmission, as a whole model's service), and are refused with 429 and
   * a retry estimate only beyond it.
   */
  maxSequences?: number
  /** Longest expected wait for a sequence slot before a request is refused (default: the batcher's budget, 1 s). */
  budgetMs?: number
  /** Requests that may wait for a slot at once (default 64); more are refused with 429. */
  maxWaiting?: number
  /** Longest a wave waits for the other sequences' steps before it runs without them (default 2 ms, as the batcher's queue delay). */
  gatherMs?: number
  /** Bound on one MoE layer's expert step, holders included (default 30 s). */
  stepTimeoutMs?: number
  /** A holder that failed a step stays out of new plans this long (default 30 s). */
  failedHolderMs?: number
  /** onnxruntime intra-op threads per graph (default 1). */
  threads?: number
  /** shoal's kernel library the stage's graphs load (LoadOptions.kernels); absent: onnxruntime's kernels. */
  kernels?: string
}

export interface ExpertServiceComponents {
  /** Live holders of this model's experts (shards key) with the memory they offer. */
  holders: () => PlacementNode[]
  /** Sends a compute frame to a holder (createExpertLinks, watched for peer loss by the caller). */
  link: ExpertLink
}

/** The current plan as /v1/mesh shows it: who holds which experts of which layer. */
export interface ExpertPlanView {
  model: string
  key: string
  layers: Array<{ layer: number, holders: Record<string, number[]> }>
  nodes: ExpertPlan['nodes']
  /** Holders left out after failing a step (recently). */
  excluded: string[]
  /** Expert steps run so far and the frame payload bytes they sent and received (all plans). */
  steps: number
  bytesOut: number
  bytesIn: number
}

export interface ExpertServiceStats {
  activeRequests: number
  /** Requests waiting for a sequence slot (daemon/engine/slots.ts). */
  waitingRequests: number
  /** Expert steps run, and the frame payload bytes they sent and received. */
  expertSteps: number
  bytesOut: number
  bytesIn: number
  /** Plans built (the first, then one per change in the holders). */
  plans: number
  /** Holder receipt parts left out because they claim other work than this stage exchanged with the holder. */
  partsRefused: number
}

export interface ExpertService extends InferenceService {
  start (): Promise<void>
  stop (): Promise<void>
  stats (): ExpertServiceStats
  /** The plan now (built from the holders now), or undefined when none can be built. */
  plan (): ExpertPlanView | undefined
}

interface Sequence extends ExpertSequence {
  /** Set when a wave failed with this sequence in it: its KV is then not to be trusted. */
  broken?: unknown
}

/** What the stage sent one holder for one request and got back (hashed as the holder's part hashes them). */
interface HolderShare {
  input: Hash
  output: Hash
  rows: number
}

const bytesOf = (a: Float32Array): Uint8Array => new Uint8Array(a.buffer, a.byteOffset, a.byteLength)

/**
 * A holder's part states the work this stage saw: its own peer id, this request, and hashes and
 * row counts equal to what was exchanged. Its signature is checked where every part's is (the
 * ingress: acceptedParts; the ledger).
 */
function matchesShare (part: Record<string, unknown>, requestId: string, peerId: string, share: HolderShare): boolean {
  const body = part.body as Partial<ReceiptPartBody> | undefined
  if (body === undefined || body === null || typeof body !== 'object') return false
  return body.peerId === peerId && body.requestId === requestId && body.tokens?.input === share.rows && body.tokens.output === share.rows &&
    body.inputHash === share.input.digest('hex') && body.outputHash === share.output.digest('hex')
}

interface PendingStep {
  seq: Sequence
  ids: number[]
  requestId: string
  pick: TokenPick
  signal: AbortSignal
  resolve: (token: number) => void
  reject: (err: unknown) => void
}

const MAX_REPLANS = 2
/** As the whole model's service (DEFAULTS.budgetMs, DEFAULT_MAX_WAITING): one admission policy for a client, whichever service answers. */
const DEFAULT_BUDGET_MS = 1_000
const DEFAULT_MAX_WAITING = 64

export function createExpertService (init: ExpertServiceInit, components: ExpertServiceComponents): ExpertService {
  const { shards } = init
  const { layout } = shards
  const shape = layout.shape
  const moe = shape.moe!
  const D = shape.hiddenSize
  const maxSequences = init.maxSequences ?? 8
  const stepTimeoutMs = init.stepTimeoutMs ?? 30_000
  const failedHolderMs = init.failedHolderMs ?? 30_000
  const budgetMs = init.budgetMs ?? DEFAULT_BUDGET_MS
  const gatherMs = init.gatherMs ?? 2
  const maxWaiting = init.maxWaiting ?? DEFAULT_MAX_WAITING
  const forward = createExpertForward({ dir: shards.dir, layout, ...(init.threads === undefined ? {} : { threads: init.threads }), ...(init.kernels === undefined ? {} : { kernels: init.kernels }) })
  // What loadTextCodec and endConditions read, from the layout.
  const manifest = {
    shape,
    generation: layout.generation!,
    tokenizerFiles: (layout.tokenizerFiles ?? []).map(path => ({ path, bytes: 0, sha256: '' })),
  } as unknown as ShardManifest
  let codec: TextCodec | undefined
  let created = 0
  let stepId = 0
  const stats = { expertSteps: 0, bytesOut: 0, bytesIn: 0, plans: 0, partsRefused: 0 }
  /** Rows routed to each expert of each MoE layer so far: the placement's histogram. */
  const histogram = moe.moeLayers.map(() => new Array<number>(moe.numExperts).fill(0))
  /** Holders that failed a step, and when. */
  const failed = new Map<string, number>()
  let current: { nodesKey: string, plan: ExpertPlan, exclude: Set<string> } | undefined
  /**
   * Per request in flight, per holder that answered rows of it: what this stage sent it and got
   * back for the request, hashed exactly as the holder hashes its part (raw f32 rows in frame
   * order), so a part that claims other work is left out of the receipt.
   */
  const holdersOf = new Map<string, Map<string, HolderShare>>()

  /** A holder answered a frame (in any attempt): it is asked for its part at the end of the frame's requests. */
  const onServed: NonNullable<ExpertStepInput['onServed']> = (peerId, f) => {
    let first = 0
    for (const span of f.spans) {
      const shares = holdersOf.get(span.id)
      if (shares !== undefined) {
        let share = shares.get(peerId)
        if (share === undefined) shares.set(peerId, share = { input: createHash('sha256'), output: createHash('sha256'), rows: 0 })
        const from = first * f.width
        const to = (first + span.rows) * f.width
        share.input.update(bytesOf(f.input.subarray(from, to)))
        share.output.update(bytesOf(f.output.subarray(from, to)))
        share.rows += span.rows
      }
      first += span.rows
    }
  }

  /** A fresh step id: compute and finish frames share one stream per holder, matched by it. */
  function nextStep (): number {
    const id = stepId
    stepId = (stepId + 1) >>> 0
    return id
  }

  function liveHolders (): PlacementNode[] {
    const now = Date.now()
    for (const [peer, at] of failed) if (now - at > failedHolderMs) failed.delete(peer)
    return components.holders().filter(h => !failed.has(h.peerId)).sort((a, b) => (a.peerId < b.peerId ? -1 : 1))
  }

  /** The plan for the holders live now: the current one while they have not changed. */
  function planNow (): NonNullable<typeof current> {
    const nodes = liveHolders()
    const nodesKey = nodes.map(n => `${n.peerId}:${n.freeBytes}`).join(',')
    if (current !== undefined && current.nodesKey === nodesKey) return current
    if (nodes.length === 0) throw new ExpertsUnplaceableError(`no expert holder of ${shards.modelId} (key ${shards.key.slice(0, 12)}…) is live in the mesh`)
    const d = placeExperts({
      moeLayers: moe.moeLayers, numExperts: moe.numExperts, expertBytes: shards.expertBytes, nodes,
      histogram: histogram.some(h => h.some(c => c > 0)) ? histogram : undefined,
      // Every expert is "hot": it gets a second copy wherever memory allows, hottest first, so a
      // holder's death is a takeover rather than a re-placement.
      hotFactor: 0, maxReplicas: 2,
    })
    if (d.kind !== 'plan') throw new ExpertsUnplaceableError(`${shards.modelId}: the live expert holders cannot hold the model: ${d.reason}`)
    stats.plans++
    current = { nodesKey, plan: d.plan, exclude: new Set() }
    return current
  }

  async function expertStep (layer: number, rows: number, base: Float32Array, input: Float32Array, experts: BigInt64Array, weights: Float32Array, requests?: RequestSpan[]): Promise<Float32Array> {
    const mi = moe.moeLayers.indexOf(layer)
    for (let attempt = 0; ; attempt++) {
      const p = planNow()
      const placement = p.plan.layers[mi]!
      const timeout = AbortSignal.timeout(stepTimeoutMs)
      try {
        const r = await runExpertStep({
          model: shards.key, step: nextStep(), placement, rows, width: D, base, input, experts, weights, topK: moe.topK,
          exclude: p.exclude, signal: timeout, ...(requests === undefined ? {} : { requests, onServed }),
        }, components.link)
        stats.expertSteps++
        stats.bytesOut += r.bytesOut
        stats.bytesIn += r.bytesIn
        r.routed.forEach((c, e) => { histogram[mi]![e]! += c })
        return r.out
      } catch (err) {
        if (timeout.aborted) throw new ShoalError('SHOAL_ERR_PEER_LOST', `the expert holders of layer ${layer} did not answer within ${stepTimeoutMs} ms`, { cause: err })
        // An expert without a live copy is re-placed over the survivors and the step runs again.
        if (errorCodeOf(err) !== 'SHOAL_ERR_PEER_LOST' || attempt >= MAX_REPLANS) throw err
      } finally {
        // Holders that failed (their copies took over, or nobody could) stay out of the next
        // plans, so the plan the next step uses, and /v1/mesh shows, is over live holders.
        const now = Date.now()
        for (const peer of p.exclude) if (!failed.has(peer)) failed.set(peer, now)
      }
    }
  }

  const queue: PendingStep[] = []
  let draining = false
  /** Ends a gather early: set while a drain waits for the rest of the sequences' steps. */
  let wake: (() => void) | undefined
  /** Steps a wave waits for: every sequence holding a slot (at most a wave's worth). */
  const waveTarget = (): number => Math.min(slots.active, maxSequences)

  /**
   * Waits, at most gatherMs, until every sequence holding a slot has queued its step. A wave's
   * tokens resolve together, but each sequence queues its next step only after its own consumer
   * has taken the token: without this the first one back would start a wave alone and the rest
   * follow in another (waves of 1 and B − 1, twice the holder round trips per token).
   */
  async function gather (): Promise<void> {
    if (queue.length >= waveTarget()) return
    await new Promise<void>(resolve => {
      const done = (): void => { clearTimeout(timer); wake = undefined; resolve() }
      const timer = setTimeout(done, gatherMs)
      wake = done
    })
  }

  async function drain (): Promise<void> {
    draining = true
    try {
      while (queue.length > 0) {
        await gather()
        const wave = queue.splice(0, maxSequences).filter(p => {
          if (!p.signal.aborted) return true
          p.reject(abortReason(p.signal))
          return false
        })
        if (wave.length === 0) continue
        try {
          const t0 = performance.now()
          const logits = await forward.run(wave, expertStep)
          // Decode waves at a full batch time the admission's estimate (prefills would overstate it).
          if (wave.length === maxSequences && wave.every(p => p.ids.length === 1)) {
            const ms = performance.now() - t0
            fullWaveMs = fullWaveMs === 0 ? ms : 0.7 * fullWaveMs + 0.3 * ms
          }
          wave.forEach((p, i) => { p.resolve(pickToken(logits[i]!, p.pick)) })
        } catch (err) {
          for (const p of wave) { p.seq.broken = err; p.reject(err) }
        }
      }
    } finally {
      draining = false
    }
  }

  function step (seq: Sequence, requestId: string, ids: number[], pick: TokenPick, signal: AbortSignal): Promise<number> {
    if (seq.broken !== undefined) return Promise.reject(seq.broken)
    return new Promise<number>((resolve, reject) => {
      queue.push({ seq, requestId, ids, pick, signal, resolve, reject })
      if (wake !== undefined && queue.length >= waveTarget()) wake()
      if (!draining) void drain()
    })
  }

  /**
   * Sends `finish` for the request to every holder that answered rows of it; with `sign`, returns
   * the parts that came back within PART_WAIT_MS (or before `signal`), in holder order.
   */
  async function finishHolders (requestId: string, sign: boolean, signal?: AbortSignal): Promise<unknown[]> {
    const shares = [...(holdersOf.get(requestId) ?? new Map<string, HolderShare>())].sort(([a], [b]) => (a < b ? -1 : 1))
    holdersOf.delete(requestId)
    const bound = AbortSignal.timeout(PART_WAIT_MS)
    const wait = signal === undefined ? bound : AbortSignal.any([signal, bound])
    const answers = await Promise.allSettled(shares.map(async ([peerId, share]) => {
      const parts = encodePayloadParts({ kind: 'finish', model: shards.key, step: nextStep(), requestId, sign })
      const f = decodePayload(await components.link(peerId, parts, wait))
      if (f.kind !== 'part' || f.part === undefined) return undefined
      if (matchesShare(f.part, requestId, peerId, share)) return f.part
      stats.partsRefused++
      return undefined
    }))
    return answers.flatMap(a => (a.status === 'fulfilled' && a.value !== undefined ? [a.value] : []))
  }

  /** ms of one wave with every slot busy, as measured (an average over recent full waves; 0 until one ran). */
  let fullWaveMs = 0
  /**
   * Sequence slots (daemon/engine slots.ts, as a whole model's service): a burst of streams queues
   * while the expected wait is within the budget, rather than all but maxSequences of it getting
   * 429 at once; refused with a retry estimate beyond the budget or past maxWaiting.
   */
  const slots = createSlots({
    slots: maxSequences,
    budgetMs,
    maxWaiting,
    stepMs: () => fullWaveMs,
    refused: (reason, retryAfterMs) => new OverloadedError(`${shards.modelId} cannot take this request now: ${reason}`, retryAfterMs),
  })


  async function * generate (request: GenerateRequest, signal: AbortSignal): AsyncGenerator<GenerateEvent> {
    const text = codec
    if (text === undefined) throw new ShoalError('SHOAL_ERR_SHUTTING_DOWN', 'the expert-parallel service is not running')
    if (request.model !== shards.modelId) throw new ModelNotFoundError(request.model, [shards.modelId])
    const promptIds = await admitPrompt(text, request, shape, signal)
    // No holders, or not enough memory among them: a 503 before any work.
    planNow()
    const scope = requestScope(signal, request.deadline)
    const progress = { left: request.maxTokens ?? shape.maxPositions - promptIds.length }
    try {
      await slots.acquire(progress, scope.signal, ownWaitBudget(request, budgetMs, Date.now()))
    } catch (err) {
      scope.dispose()
      throw scope.signal.aborted ? abortReason(scope.signal) : err
    }
    const seq: Sequence = forward.newSequence()
    const rng = createRng(request.sampling.seed)
    const source: TokenSource = {
      prefill: async (ids, s) => await step(seq, request.requestId, ids, nextPick(request.sampling, rng), s),
      decode: async (id, _position, s) => {
        progress.left = Math.max(0, progress.left - 1)
        return await step(seq, request.requestId, [id], nextPick(request.sampling, rng), s)
      },
    }
    holdersOf.set(request.requestId, new Map())
    let finished = false
    try {
      let tokens: TokenSource = source
      if (request.maxTokens === undefined || request.maxTokens > 0) {
        // Prefill before `start`, so a failure there is a plain HTTP error.
        const first = await source.prefill(promptIds, scope.signal)
        tokens = { prefill: async () => first, decode: source.decode }
      }
      yield { type: 'start', promptTokenIds: promptIds, route: [init.nodeId], manifestHash: shards.key, receiptId: request.requestId }
      for await (const event of generateSequence({ source: tokens, codec: text, promptIds, ...endConditions(request, manifest), signal: scope.signal })) {
        if (event.type !== 'end') {
          yield event
          continue
        }
        // The holders' signed shares, for the ingress's receipt (bounded: a holder that does not
        // answer in time is left out, the completion is not held up).
        finished = true
        const parts = await finishHolders(request.requestId, true, signal)
        yield parts.length === 0 ? event : { ...event, receiptParts: [...(event.receiptParts ?? []), ...parts] }
      }
    } catch (err) {
      throw scope.signal.aborted ? abortReason(scope.signal) : err
    } finally {
      scope.dispose()
      slots.release(progress)
      // Failed or cancelled: the holders forget what they kept for it (nobody waits for that).
      if (!finished) void finishHolders(request.requestId, false).catch(() => {})
    }
  }

  return {
    async start () {
      if (layout.generation === undefined || !(layout.tokenizerFiles ?? []).includes('tokenizer.json')) {
        throw new ShoalError('SHOAL_ERR_SHARD_INVALID', `${shards.dir}: the layout names no tokenizer or generation defaults (compiled before the daemon served expert-parallel shards: compile it again)`)
      }
      await forward.open()
      codec = await loadTextCodec(shards.dir, manifest)
      created = Math.floor(Date.now() / 1000)
    },
    async stop () {
      const c = codec
      codec = undefined
      slots.failWaiting(new ShoalError('SHOAL_ERR_SHUTTING_DOWN', 'the expert-parallel service is stopping'))
      await c?.close()
      await forward.close()
    },
    models (): ModelCard[] {
      if (codec === undefined) return []
      return [{ id: shards.modelId, created, ownedBy: 'shoal', contextLength: shape.maxPositions, servedBy: [init.nodeId] }]
    },
    generate,
    stats: () => ({ activeRequests: slots.active, waitingRequests: slots.waiting, ...stats }),
    plan () {
      let p: NonNullable<typeof current>
      try {
        p = planNow()
      } catch {
        return undefined
      }
      return {
        model: shards.modelId,
        key: shards.key,
        layers: p.plan.layers.map(l => {
          const holders: Record<string, number[]> = {}
          l.holders.forEach((hs, e) => { for (const h of hs) (holders[h] ??= []).push(e) })
          return { layer: l.layer, holders }
        }),
        nodes: p.plan.nodes,
        excluded: [...new Set([...failed.keys(), ...p.exclude])],
        steps: stats.expertSteps,
        bytesOut: stats.bytesOut,
        bytesIn: stats.bytesIn,
      }
    },
  }
}
