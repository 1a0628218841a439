/**
 * The serving side of a stage node: as a middle or last stage it takes open / activation /
 * cancel / finish frames for requests a coordinator drives. KV is keyed by request id;
 * activations of one request run in order, different requests interleave freely; the last stage
 * samples and sends only the token id (or a verify's verdict) to the coordinator. A request's
 * state is dropped on cancel, on error, at its deadline, after an idle timeout, and when the link
 * to a neighbour it depends on goes down; on finish it signs this stage's receipt part first.
 * Prefix reuse: a finish with `keep` keeps the request's KV under the coordinator's key instead of
 * freeing it, and an open with `fromKey` starts from such a prefix (or fails with
 * SHOAL_ERR_STAGE_PREFIX_GONE, which the coordinator answers by reopening without it). On a
 * rebuilt chain an open whose `pullFrom` names this hop first pulls the prefix's KV of this
 * stage's layers from the peer that kept it, before any activation of the request runs.
 */
import { roundTripActivation } from './activations.ts'
import { createHash } from 'node:crypto'
import type { Hash } from 'node:crypto'
import { serializeError } from '../errors.ts'
import { createReceiptPart } from '../ledger/index.ts'
import { createRng, nextPick } from '../engine/index.ts'
import type { Rng, StageEngine, StageStepInput, StepOutput, TokenPick } from '../engine/index.ts'
import { StageConfigError, StageLostError, StagePrefixGoneError, StageWireError } from './errors.ts'
import { errorBody, remoteError } from './frame-errors.ts'
import type { Links } from './links.ts'
import type { FinishKeep, OpenBody, StageFrame } from './wire.ts'
import { checkDrafts } from './verify.ts'
import { MAX_TIMER_MS } from '../abort.ts'

export interface StageServerInit {
  engine: StageEngine
  modelId: string
  manifestHash: string
  /** Silence after which a served request's state is dropped. */
  idleTimeoutMs: number
  signer?: { peerId: string, secretKey: Uint8Array }
  authorize?: (from: string) => Error | undefined
  /** This node's peer id. */
  self: string
  links: Links
  /** The node's step, free and rollback (through its batcher when it has one). */
  step: (seqId: string, input: StageStepInput, positions: number[], pick: TokenPick | undefined, signal: AbortSignal, verify?: { logitsToKeep: number }) => Promise<StepOutput>
  free: (seqId: string) => Promise<void>
  rollback: (seqId: string, length: number, signal: AbortSignal) => Promise<void>
  /** Ends a sequence keeping its KV as a prefix (stage-node.ts keep); absent: finish frees. */
  keep?: (seqId: string, key: string, owner: string, length: number) => Promise<{ length: number }>
  /** Drops a coordinator's kept prefixes (stage-node.ts evictPrefixes with an owner). */
  evict?: (keys: readonly string[], owner: string) => Promise<void>
  /** Opens a sequence from a kept prefix (stage-node.ts openFrom); absent: every fromKey is gone. */
  openFrom?: (seqId: string, key: string, owner: string, length: number, signal: AbortSignal) => Promise<void>
  /** Pulls a kept prefix of this stage's layers from the peer that kept it (stage-node.ts pullKept); absent: never pulls. */
  pullKept?: (holder: string, key: string, owner: string, tokens: readonly number[], signal: AbortSignal) => Promise<unknown>
}

export interface StageServer {
  /** Handles a frame that is not for a watched request. */
  handle (f: StageFrame, from: string): void
  /** A link went down: every request that depends on that peer fails. */
  linkDown (peerId: string): void
  /** Drops every served request without cancelling downstream (the node stops). */
  dropAll (): void
  /** Requests served now. */
  readonly size: number
  /** The longest chain (stages) among the served requests, at least 1. */
  longestChain (): number
}

interface Served {
  id: string
  open: OpenBody
  upstream: string
  next: string | undefined
  rng: Rng | undefined
  tail: Promise<void>
  ctl: AbortController
  timers: Array<ReturnType<typeof setTimeout>>
  idle: ReturnType<typeof setTimeout> | undefined
  /** What this stage received and produced for the request, for its signed receipt part. */
  received: Hash
  produced: Hash
  rowsIn: number
  rowsOut: number
  startedAt: number
  /** Positions this stage's KV holds for the request. */
  held: number
}

/** Bytes of a tensor, for hashing without a copy. */
const bytesOf = (a: Float32Array): Uint8Array => new Uint8Array(a.buffer, a.byteOffset, a.byteLength)

const SEND_TIMEOUT_MS = 30_000

export function createStageServer (init: StageServerInit): StageServer {
  const { engine, links, self, step, free, rollback } = init
  /** Ends a dropped request's sequence: kept as a prefix when its finish asked, else freed; the positions kept. */
  const release = async (s: Served, keep: FinishKeep | undefined): Promise<number> => {
    if (keep === undefined || init.keep === undefined) { await free(s.id); return 0 }
    return await init.keep(s.id, keep.keep, s.open.returnTo, keep.length).then(r => r.length, async () => { await free(s.id); return 0 })
  }
  const stage = engine.stage
  const idleMs = init.idleTimeoutMs
  const served = new Map<string, Served>()

  const sendSoon = (peerId: string, frame: StageFrame): void => {
    links.send(peerId, frame, AbortSignal.timeout(SEND_TIMEOUT_MS)).catch(() => {})
  }

  /** Drops a served request: KV freed after its running step stops; cancel goes downstream. */
  function drop (s: Served, cancelDownstream: boolean, keep?: FinishKeep): void {
    if (served.get(s.id) !== s) return
    served.delete(s.id)
    s.ctl.abort(new StageLostError('request dropped'))
    for (const t of s.timers) clearTimeout(t)
    clearTimeout(s.idle)
    void s.tail.finally(async () => {
      const kept = await release(s, keep).catch(() => 0)
      // The coordinator holds an open from this key until every stage answered (keep-acks.ts).
      if (keep?.ack === true) sendSoon(s.open.returnTo, { kind: 'kept', requestId: s.id, keep: keep.keep, length: kept })
    })
    if (cancelDownstream && s.next !== undefined) sendSoon(s.next, { kind: 'cancel', requestId: s.id })
  }

  function fail (s: Served, err: unknown): void {
    if (served.get(s.id) !== s) return
    if (s.open.returnTo !== self) sendSoon(s.open.returnTo, { kind: 'error', requestId: s.id, error: errorBody(err) })
    drop(s, true)
  }

  function touch (s: Served): void {
    clearTimeout(s.idle)
    s.idle = setTimeout(() => fail(s, new StageLostError(`no frame for request ${s.id} in ${idleMs} ms`)), idleMs)
  }

  function checkOpen (o: OpenBody): void {
    const hop = o.chain[o.hop]!
    if (hop.peerId !== self) throw new StageConfigError(`open frame addressed to ${hop.peerId}, not this node`)
    if (o.modelId !== init.modelId || o.manifestHash !== init.manifestHash) throw new StageWireError('SHOAL_ERR_STAGE_MISMATCH', `this node serves ${init.modelId} (manifest ${init.manifestHash.slice(0, 12)}), not ${o.modelId} (manifest ${o.manifestHash.slice(0, 12)})`)
    if (hop.layers[0] !== stage.layers[0] || hop.layers[1] !== stage.layers[1]) throw new StageWireError('SHOAL_ERR_STAGE_MISMATCH', `this node holds layers ${stage.layers.join('-')}, not ${hop.layers.join('-')}`)
    if (stage.hasEmbedding) throw new StageWireError('SHOAL_ERR_STAGE_MISMATCH', 'the embedding stage takes no activations')
    if ((o.hop === o.chain.length - 1) !== stage.hasHead) throw new StageWireError('SHOAL_ERR_STAGE_MISMATCH', 'only the stage with the head may end a chain')
  }

  function onOpen (f: Extract<StageFrame, { kind: 'open' }>, from: string): void {
    const o = f.open
    try {
      if (served.has(f.requestId)) throw new StageWireError('SHOAL_ERR_STAGE_MALFORMED', `request ${f.requestId} is already open here`)
      const refused = init.authorize?.(from)
      if (refused !== undefined) throw refused
      checkOpen(o)
    } catch (err) {
      sendSoon(from, { kind: 'error', requestId: f.requestId, error: serializeError(err) })
      return
    }
    const last = o.hop === o.chain.length - 1
    const s: Served = {
      id: f.requestId,
      open: o,
      upstream: from,
      next: last ? undefined : o.chain[o.hop + 1]!.peerId,
      rng: undefined,
      tail: Promise.resolve(),
      ctl: new AbortController(),
      timers: [],
      idle: undefined,
      received: createHash('sha256'),
      produced: createHash('sha256'),
      rowsIn: 0,
      rowsOut: 0,
      startedAt: Date.now(),
      held: 0,
    }
    if (last) {
      s.rng = createRng(o.sampling.seed)
      for (let i = 0; i < o.rngSkip; i++) s.rng()
    }
    served.set(s.id, s)
    const untilDeadline = o.deadline - Date.now()
    s.timers.push(setTimeout(() => fail(s, new StageLostError('the request deadline passed at a stage')), Math.max(0, Math.min(untilDeadline, MAX_TIMER_MS))))
    touch(s)
    // Open downstream right away: frames on one link keep their order, so it precedes our output.
    if (s.next !== undefined) sendSoon(s.next, { kind: 'open', requestId: s.id, open: { ...o, hop: o.hop + 1 } })
    const prefix = o.fromKey === undefined ? undefined : { key: o.fromKey, length: o.fromLength! }
    // A rebuilt chain: this stage's layers of the prefix are with the peer that kept them. The
    // request's activations queue behind the pull (they run on s.tail); whatever the pull's
    // outcome, the open from the key decides (held: reused; not: PREFIX_GONE, recomputed).
    const pull = o.pullFrom?.find(p => p.hop === o.hop)
    const pulled = prefix === undefined || pull === undefined || init.pullKept === undefined || o.fromTokens === undefined
      ? Promise.resolve()
      : init.pullKept(pull.peerId, prefix.key, o.returnTo, o.fromTokens, s.ctl.signal).then(() => {})
    s.tail = (prefix === undefined
      ? engine.open(s.id, s.ctl.signal).then(() => {})
      : init.openFrom === undefined
        ? Promise.reject(new StagePrefixGoneError('this stage keeps no prefixes'))
        : pulled.then(async () => { await init.openFrom!(s.id, prefix.key, o.returnTo, prefix.length, s.ctl.signal) }).then(() => { s.held = prefix.length })
    ).catch((err: unknown) => fail(s, err))
  }

  function onActivation (f: Extract<StageFrame, { kind: 'activation' }>, from: string): void {
    const s = served.get(f.requestId)
    if (s === undefined) {
      sendSoon(from, { kind: 'error', requestId: f.requestId, error: serializeError(new StageWireError('SHOAL_ERR_STAGE_UNKNOWN_REQUEST', `no open request ${f.requestId} on this stage`)) })
      return
    }
    if (f.width !== stage.hiddenSize) {
      fail(s, new StageWireError('SHOAL_ERR_STAGE_MISMATCH', `activation width ${f.width}, this stage's hidden size is ${stage.hiddenSize}`))
      return
    }
    touch(s)
    s.received.update(bytesOf(f.data))
    s.rowsIn += f.rows
    const positions = Array.from({ length: f.rows }, (_, i) => f.start + i)
    s.tail = s.tail.then(async () => {
      if (served.get(s.id) !== s) return
      if (f.start > s.held) throw new StageWireError('SHOAL_ERR_STAGE_MALFORMED', `activation starts at ${f.start}; this stage holds ${s.held} positions`)
      // Drafts the chain rejected: the KV goes back to where this activation starts.
      if (f.start < s.held) await rollback(s.id, f.start, s.ctl.signal)
      s.held = f.start
      const verify = f.drafts
      // The last stage picks the token in its engine worker (the draw from this sequence's seeded
      // generator made here first), so only the id comes back from the worker; a verify needs the
      // logits of every row instead.
      const pick = s.next === undefined && f.final && verify === undefined ? nextPick(s.open.sampling, s.rng!) : undefined
      // Every row of a verify is wanted, on every stage: the last one checks their logits; on an
      // earlier stage (no head) it is what tells shoal's kernels a step is a verify, which they
      // compute position by position as decoding does (engine/native/swap.ts). A greedy request's
      // drafts the last stage's engine checks itself (ids back, not rows of logits; the rejected
      // positions rolled back there).
      const greedyDrafts = s.next === undefined && verify !== undefined && s.open.sampling.temperature <= 0 ? verify : undefined
      const out = await step(s.id, { hidden: f.data }, positions, pick, s.ctl.signal, verify === undefined ? undefined : { logitsToKeep: f.rows, ...(greedyDrafts === undefined ? {} : { greedyDrafts }) })
      s.held = out.kind === 'verdict' ? f.start + 1 + out.accepted : f.start + f.rows
      if (s.next !== undefined) {
        if (out.kind !== 'hidden') throw new StageConfigError('a middle stage must return hidden states')
        // The chain's encoding (its open frame's); the part hashes what the next stage receives.
        const encoding = s.open.activations
        s.produced.update(bytesOf(encoding === undefined ? out.data : roundTripActivation(encoding, out.data, out.count, out.hidden)))
        s.rowsOut += out.count
        await links.send(s.next, { kind: 'activation', requestId: s.id, start: f.start, final: f.final, rows: out.count, width: out.hidden, data: out.data, ...(verify === undefined ? {} : { drafts: verify }), ...(encoding === undefined ? {} : { encoding }) }, s.ctl.signal)
      } else if (verify !== undefined) {
        let accepted: number
        let tokenId: number
        if (out.kind === 'verdict' && greedyDrafts !== undefined) {
          if (!Number.isSafeInteger(out.accepted) || out.accepted < 0 || out.accepted > verify.length) throw new StageConfigError(`the engine accepted ${out.accepted} of ${verify.length} drafts`)
          accepted = out.accepted
          tokenId = out.id
        } else {
          if (out.kind !== 'logits' || out.count !== f.rows) throw new StageConfigError('the last stage must return logits for every verified row')
          // Greedy by id, or speculative sampling with the drafts as point masses (verify.ts).
          ;({ accepted, tokenId } = checkDrafts(out.data, out.vocab, verify, s.open.sampling, s.rng!))
        }
        const position = f.start + accepted + 1
        s.produced.update(new Uint8Array(Uint32Array.of(position, tokenId).buffer))
        s.rowsOut += accepted + 1
        await links.send(s.open.returnTo, { kind: 'verdict', requestId: s.id, position, accepted, tokenId }, s.ctl.signal)
      } else if (f.final) {
        if (out.kind !== 'token') throw new StageConfigError('the last stage must return a token')
        const tokenId = out.id
        s.produced.update(new Uint8Array(Uint32Array.of(f.start + f.rows, tokenId).buffer))
        s.rowsOut++
        await links.send(s.open.returnTo, { kind: 'token', requestId: s.id, position: f.start + f.rows, tokenId }, s.ctl.signal)
      }
    }).catch((err: unknown) => { if (!s.ctl.signal.aborted) fail(s, err) })
  }

  function handle (f: StageFrame, from: string): void {
    switch (f.kind) {
      case 'open': onOpen(f, from); return
      case 'activation': onActivation(f, from); return
      case 'cancel': {
        const s = served.get(f.requestId)
        if (s !== undefined) drop(s, true)
        return
      }
      case 'finish': {
        const s = served.get(f.requestId)
        if (s !== undefined) void finish(s, f.keep, f.evict)
        return
      }
      case 'part': return // for a request no longer watched
      case 'error': {
        // From downstream: pass it to the coordinator and drop our part.
        const s = served.get(f.requestId)
        if (s !== undefined) fail(s, remoteError(f.error))
        return
      }
      case 'token':
      case 'verdict':
      case 'kept': return // for a request no longer watched (kept: a node that coordinates takes it first)
    }
  }

  /** The request completed: sign this stage's part for the coordinator, then pass finish on and drop. */
  async function finish (s: Served, keep: FinishKeep | undefined, evict: string[] | undefined): Promise<void> {
    // Steps still running for the request finish first, so the hashes cover everything.
    await s.tail.catch(() => {})
    if (served.get(s.id) !== s) return
    // Always answer, with {} when this stage signs nothing, so the coordinator need not wait it out.
    let part: Record<string, unknown> = {}
    const signer = init.signer
    if (signer !== undefined) {
      try {
        part = createReceiptPart({
          requestId: s.open.receiptId ?? s.id,
          peerId: signer.peerId,
          model: s.open.modelId,
          layers: [stage.layers[0], stage.layers[1]],
          inputHash: s.received.digest('hex'),
          outputHash: s.produced.digest('hex'),
          tokens: { input: s.rowsIn, output: s.rowsOut },
          timing: { startedAt: s.startedAt, durationMs: Date.now() - s.startedAt },
        }, signer.secretKey) as unknown as Record<string, unknown>
      } catch {
        // A part that cannot be made is left out; the coordinator's receipt still names this stage.
      }
    }
    sendSoon(s.open.returnTo, { kind: 'part', requestId: s.id, part })
    if (s.next !== undefined) sendSoon(s.next, { kind: 'finish', requestId: s.id, ...(keep === undefined ? {} : { keep }), ...(evict === undefined ? {} : { evict }) })
    // Prefixes the coordinator's index dropped: only its own keys go.
    if (evict !== undefined) void init.evict?.(evict, s.open.returnTo).catch(() => {})
    drop(s, false, keep)
  }

  return {
    handle,
    linkDown (peerId) {
      for (const s of [...served.values()]) {
        if (s.upstream === peerId || s.next === peerId || s.open.returnTo === peerId) fail(s, new StageLostError(`lost the link to stage peer ${peerId}`, peerId))
      }
    },
    dropAll () {
      for (const s of [...served.values()]) drop(s, false)
    },
    get size () { return served.size },
    longestChain () {
      let stages = 1
      for (const s of served.values()) stages = Math.max(stages, s.open.chain.length)
      return stages
    },
  }
}
