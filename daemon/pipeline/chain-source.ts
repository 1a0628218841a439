/**
 * The coordinator's side of one request on a chain, as a TokenSource for the engine's decode loop
 * (generateSequence): stage 0 runs here (this node's engine), its activations go down the chain,
 * the last stage samples and the token id comes back. Sampling params travel in the open frame. When a stage is lost the
 * source rebuilds the chain without that peer and replays the prompt plus every token so far
 * (with the RNG advanced past the draws already made), so the caller sees no error; past
 * `maxReplays` it fails with SHOAL_ERR_PEER_LOST. A stage that cannot be reached when the chain
 * opens is left out the same way. Until the first token came back nothing was delivered, so a
 * chain that could not be completed by then is SHOAL_ERR_CHAIN_INCOMPLETE (503) — the same status
 * whether the mesh already knew the stage was gone (no chain forms) or not yet (it fails on
 * contact). Every wait has an idle timeout, cut short for a stage the mesh has stopped hearing from.
 *
 * Speculative decoding (`verify`): one traversal carries a token and its drafts; the last stage
 * answers with how many drafts stand and its own next token. Each stage sets its KV back to where
 * the next activation starts, so rejected drafts cost no extra message; a stage lost mid-verify is
 * replayed like any step (the replay decodes plainly, so no draft goes unchecked).
 *
 * Prefix reuse (`prefix`, service.ts): a formed chain that kept a prefix of the prompt opens every
 * stage from its key (stage 0 here, the others through the open frame's fromKey) and prefills
 * only the rest; at finish every stage keeps the request's KV under a new key and says when it has
 * (an open from that key waits for those answers, bounded: keep-acks.ts). A stage that no
 * longer holds the key answers SHOAL_ERR_STAGE_PREFIX_GONE: the request is reopened without the
 * prefix and prefilled whole (a fresh wire id, so nothing of the first open mixes in).
 */
import { errorCodeOf, ShoalError } from '../errors.ts'
import type { TokenSource } from '../engine/index.ts'
import type { SamplingParams } from '../service.ts'
import { StageLostError } from './errors.ts'
import { ChainIncompleteError, PEER_LOST_IDLE_MS } from '../routing/index.ts'
import type { StageNode, TokenWatch } from './stage-node.ts'
import { MAX_FRAME_BYTES } from './wire.ts'
import type { ChainHop, StagePull } from './wire.ts'
import type { ActivationEncoding } from './activations.ts'

export interface ChainTokenSourceInit {
  /** The coordinator's node; its engine holds stage 0. */
  node: StageNode
  requestId: string
  sampling: SamplingParams
  /** Epoch ms. */
  deadline: number
  /** Forms a chain (stage 0 = this node) avoiding `exclude`; throws a typed error when there is none. */
  formChain (exclude: readonly string[]): ChainHop[]
  /** Longest wait for the token of one step (default 30 s). */
  idleTimeoutMs?: number
  /**
   * A signal that fires when the mesh stops hearing from a peer (suspect or gone). A stage whose
   * signal fired and that then leaves a token wait silent for PEER_LOST_IDLE_MS is lost: the
   * chain is rebuilt without it at once, not after the idle timeout.
   */
  peerLost?: (peerId: string) => { signal: AbortSignal, release: () => void }
  /** Chain rebuilds after a lost stage (default 2; 0 = fail at once). */
  maxReplays?: number
  /** Positions per prefill activation frame (default 256, capped by the frame size). */
  prefillChunk?: number
  /**
   * The chain's activation encoding (activations.ts): 'f32' (default) is exact; 'f16' and 'int8'
   * send 2 and ~1 bytes a value on every hop, for slow links. It travels in the open frame, so
   * every stage of the chain sends its activations the same way.
   */
  activations?: ActivationEncoding
  /**
   * Which encoding a formed chain is opened with (chainEncoding: `activations` when every stage
   * accepts it, else f32); without it, `activations` as given. Asked again for a replay's chain.
   */
  encodingFor?: (chain: ChainHop[]) => ActivationEncoding
  /** Prefix reuse on this request's chains (absent: every open prefills everything, nothing is kept). */
  prefix?: ChainPrefix
  /**
   * Longest wait of an open from a kept prefix for the stages that have not yet acknowledged
   * keeping it (default KEPT_WAIT_MS); past it the open prefills everything.
   */
  keptWaitMs?: number
}

/** What a chain source asks of the coordinator's prefix index (service.ts). */
export interface ChainPrefix {
  /**
   * A kept prefix of the request's prompt that this formed chain (its peers and layers, and its
   * activation encoding) holds: the key and the positions to reuse (at least two prompt positions
   * are left to prefill). With `pullFrom`, a rebuilt chain's: those stages pull their layers of
   * the key from the peers named, checking the KV against `tokens` (the prefix's ids). Undefined:
   * prefill everything.
   */
  acquire (chain: readonly ChainHop[], encoding: ActivationEncoding): { key: string, length: number, pullFrom?: StagePull[], tokens?: number[] } | undefined
  /**
   * A stage of the chain (or stage 0) no longer holds `key`: forget it. `pulled`: the open asked
   * stages to pull it (a rebuilt chain), so a refusal may be the pull's, not a stage that keeps nothing.
   */
  lost (key: string, pulled?: boolean): void
  /**
   * At finish: the key and positions every stage of `chain` should keep of the request's KV, and
   * a callback told what stage 0 kept; undefined: keep nothing.
   */
  keep (chain: readonly ChainHop[], encoding: ActivationEncoding): { key: string, length: number, kept (r: { length: number, bytes: number }): void } | undefined
  /** At finish: keys the coordinator's index dropped that this chain's other stages may still keep (taken: sent once). */
  evictions? (chain: readonly ChainHop[], encoding: ActivationEncoding): string[]
}

/** Errors that mean a stage did not open the request from its prefix (the request is reopened without it). */
function prefixRefused (err: unknown): boolean {
  const code = errorCodeOf(err)
  // A stage that refused the prefix drops the request, so the stage before it may report the
  // request unknown before the refusal itself arrives.
  return code === 'SHOAL_ERR_STAGE_PREFIX_GONE' || code === 'SHOAL_ERR_STAGE_UNKNOWN_REQUEST'
}

export interface ChainTokenSource extends TokenSource {
  /** Peer ids of the current chain, stage 0 first. */
  readonly route: string[]
  /** The chain in order, with each stage's layer range (for the receipt). */
  readonly hops: ChainHop[]
  readonly replays: number
  /** Prompt positions the current chain was opened with from a kept prefix (0: prefilled whole). */
  readonly reused: number
  /** The peers whose kept KV the current chain's moved stages pulled that prefix from (a rebuilt chain; else empty). */
  readonly movedFrom: string[]
  /** Forms the chain and opens the request on it (prefill does this when not done yet). */
  connect (signal: AbortSignal): Promise<void>
  /**
   * The request completed: asks every stage to sign its receipt part (finish down the chain) and
   * returns the parts that arrive before the signal fires; frees stage 0's KV.
   */
  finish (signal: AbortSignal): Promise<Array<Record<string, unknown>>>
  /** Ends the request on every stage (cancel down the chain) and frees stage 0's KV. */
  close (): Promise<void>
  /**
   * Feeds `tokenId` at `position` with `drafts` after it through the chain in one traversal;
   * returns how many drafts the last stage accepted and its token after them.
   */
  verify (tokenId: number, position: number, drafts: number[], signal: AbortSignal): Promise<{ accepted: number, next: number }>
}

export function createChainTokenSource (init: ChainTokenSourceInit): ChainTokenSource {
  const { node } = init
  const idleMs = init.idleTimeoutMs ?? 30_000
  const maxReplays = init.maxReplays ?? 2
  const width = node.engine.stage.hiddenSize
  const chunk = Math.max(1, Math.min(init.prefillChunk ?? 256, Math.floor((MAX_FRAME_BYTES - 1024) / (width * 4))))
  /** The current chain's lossy encoding (undefined: f32). */
  let encoding: 'f16' | 'int8' | undefined
  const history: number[] = []
  const excluded: string[] = []
  let sampled = 0
  let attempt = 0
  let chain: ChainHop[] = []
  let wireId = init.requestId
  let watch: TokenWatch | undefined
  /** Loss signals of the current chain's stages after stage 0. */
  let losses: Array<{ peerId: string, signal: AbortSignal, release: () => void }> = []
  let live = false
  /** Positions stage 0's KV holds (more than the history after a verify whose drafts were rejected). */
  let held = 0
  /** Opens so far (each gets its own wire id). */
  let opens = 0
  /** The kept prefix the current chain was opened from. */
  let from: { key: string, length: number, pullFrom?: StagePull[], tokens?: number[] } | undefined
  /** A stage refused a prefix: the rest of this request prefills whole. */
  let prefixOff = false

  async function begin (signal: AbortSignal): Promise<void> {
    chain = init.formChain(excluded)
    if (chain.length < 2 || chain[0]!.peerId !== node.peerId) throw new ShoalError('SHOAL_ERR_INTERNAL', 'a chain must start at the coordinator and have a second stage')
    const chosen = init.encodingFor?.(chain) ?? init.activations ?? 'f32'
    encoding = chosen === 'f32' ? undefined : chosen
    wireId = opens === 0 ? init.requestId : `${init.requestId}~r${opens}`
    opens++
    watch = node.watch(wireId, chain.slice(1).map(h => h.peerId))
    losses = init.peerLost === undefined ? [] : chain.slice(1).map(h => ({ peerId: h.peerId, ...init.peerLost!(h.peerId) }))
    live = true
    held = 0
    from = prefixOff ? undefined : init.prefix?.acquire(chain, chosen)
    // The request that kept it may have ended a moment ago, its stages' keeps still under way: an
    // open that overtook them would be refused and recompute. Waited for, bounded.
    if (from !== undefined) {
      const readiness = await node.keepAcks.ready(from.key, signal, init.keptWaitMs)
      if (readiness === 'gone') {
        // A stage kept none of it: every open from it would be refused.
        init.prefix?.lost(from.key)
        from = undefined
      } else if (readiness === 'late') from = undefined
    }
    if (from !== undefined) {
      try {
        await node.openFrom(wireId, from.key, node.peerId, from.length, signal)
        held = from.length
      } catch (err) {
        if (signal.aborted) throw err
        // Stage 0 lost it: the chain opens plainly.
        init.prefix?.lost(from.key)
        from = undefined
      }
    }
    if (from === undefined) await node.engine.open(wireId, signal)
    await node.send(chain[1]!.peerId, {
      kind: 'open',
      requestId: wireId,
      open: {
        modelId: node.modelId,
        manifestHash: node.manifestHash,
        chain,
        hop: 1,
        returnTo: node.peerId,
        sampling: init.sampling,
        rngSkip: init.sampling.temperature > 0 ? sampled : 0,
        deadline: init.deadline,
        // Stages sign their parts with the receipt id; only a replay's frames use another id.
        ...(wireId === init.requestId ? {} : { receiptId: init.requestId }),
        ...(encoding === undefined ? {} : { activations: encoding }),
        ...(from === undefined ? {} : { fromKey: from.key, fromLength: from.length }),
        ...(from?.pullFrom === undefined || from.tokens === undefined ? {} : { pullFrom: from.pullFrom, fromTokens: from.tokens }),
      },
    }, signal)
  }

  function releaseLosses (): void {
    for (const l of losses) l.release()
    losses = []
  }

  async function end (): Promise<void> {
    if (!live) return
    live = false
    releaseLosses()
    watch?.close()
    // The cancel is best effort and not awaited: the next stage may be the one that died (its
    // downstream then frees on the link loss, the deadline or its idle timer).
    node.send(chain[1]!.peerId, { kind: 'cancel', requestId: wireId }, AbortSignal.timeout(5_000)).catch(() => {})
    await node.free(wireId).catch(() => {})
  }

  async function finish (signal: AbortSignal): Promise<Array<Record<string, unknown>>> {
    if (!live) return []
    live = false
    releaseLosses()
    const w = watch!
    const keep = init.prefix?.keep(chain, encoding ?? 'f32')
    const evict = init.prefix?.evictions?.(chain, encoding ?? 'f32') ?? []
    // Every stage answers once its keep is done; an open from the key waits for that.
    if (keep !== undefined) node.keepAcks.expect(keep.key, chain.slice(1).map(h => h.peerId))
    node.send(chain[1]!.peerId, {
      kind: 'finish',
      requestId: wireId,
      ...(keep === undefined ? {} : { keep: { keep: keep.key, length: keep.length, ack: true } }),
      ...(evict.length === 0 ? {} : { evict }),
    }, AbortSignal.timeout(5_000)).catch(() => {})
    const parts = await w.parts(chain.length - 1, signal)
    w.close()
    if (keep === undefined) await node.free(wireId).catch(() => {})
    else keep.kept(await node.keep(wireId, keep.key, node.peerId, keep.length).catch(() => ({ length: 0, bytes: 0 })))
    return parts
  }

  /**
   * Runs `ids` at positions start.. through the chain; resolves with the sampled next token. With
   * `drafts` (ids = a token and its drafts, one traversal) the last stage's verdict comes back.
   */
  async function run (ids: number[], start: number, signal: AbortSignal, drafts?: number[]): Promise<{ accepted: number, next: number }> {
    const w = watch!
    if (held > start) await node.rollback(wireId, start, signal)
    held = start
    for (let a = 0; a < ids.length; a += chunk) {
      const part = ids.slice(a, a + chunk)
      // A verify's rows all wanted: stage 0 computes them as decoding would (stage-server.ts).
      const out = await node.step(wireId, { tokenIds: part }, part.map((_, i) => start + a + i), undefined, signal, drafts === undefined ? undefined : { logitsToKeep: part.length })
      if (out.kind !== 'hidden') throw new ShoalError('SHOAL_ERR_INTERNAL', 'stage 0 of a chain must return hidden states')
      held = start + a + part.length
      const final = a + chunk >= ids.length
      await node.send(chain[1]!.peerId, { kind: 'activation', requestId: wireId, start: start + a, final, rows: out.count, width: out.hidden, data: out.data, ...(drafts === undefined ? {} : { drafts }), ...(encoding === undefined ? {} : { encoding }) }, signal)
    }
    const got = await nextToken(w, signal)
    const accepted = got.accepted ?? 0
    if ((drafts === undefined) !== (got.accepted === undefined) || accepted > (drafts?.length ?? 0) || got.position !== start + accepted + (drafts === undefined ? ids.length : 1)) {
      throw new ShoalError('SHOAL_ERR_INTERNAL', `answer for position ${got.position} (${got.accepted ?? 'no'} accepted) does not fit the step at ${start} of ${ids.length}`)
    }
    // The last stage's random draws so far (a replay skips them): one per plain step; a verify
    // draws once per draft examined and once for the token after them (verify.ts).
    sampled += drafts === undefined ? 1 : accepted + (accepted < drafts.length ? 1 : 0) + 1
    return { accepted, next: got.tokenId }
  }

  /**
   * The next token, bounded by the idle timeout, and by PEER_LOST_IDLE_MS of silence once the
   * mesh has lost contact with a stage (that stage is then the one reported lost).
   */
  async function nextToken (w: TokenWatch, signal: AbortSignal): Promise<{ position: number, tokenId: number, accepted?: number }> {
    const ctl = new AbortController()
    let lost: StageLostError | undefined
    const stop = (err: StageLostError): void => { lost ??= err; ctl.abort() }
    const timers = [setTimeout(() => { stop(new StageLostError(`no token from the chain ${chain.map(h => h.peerId).join(' → ')} in ${idleMs} ms`)) }, idleMs)]
    const offs: Array<() => void> = []
    for (const { peerId, signal: gone } of losses) {
      const onLost = (): void => {
        timers.push(setTimeout(() => { stop(new StageLostError(`stage ${peerId} sent nothing for ${PEER_LOST_IDLE_MS} ms after the mesh lost contact with it`, peerId)) }, PEER_LOST_IDLE_MS))
      }
      if (gone.aborted) onLost()
      else {
        gone.addEventListener('abort', onLost, { once: true })
        offs.push(() => { gone.removeEventListener('abort', onLost) })
      }
    }
    try {
      return await w.next(AbortSignal.any([signal, ctl.signal]))
    } catch (err) {
      if (!signal.aborted && lost !== undefined) throw lost
      throw err
    } finally {
      for (const t of timers) clearTimeout(t)
      for (const off of offs) off()
    }
  }

  /** A lost stage before any token came back: the chain is incomplete (nothing was delivered). */
  function beforeFirstToken (err: unknown): unknown {
    if (!(err instanceof StageLostError) || sampled > 0) return err
    return new ChainIncompleteError(`no complete chain could be reached: ${err.message}`)
  }

  /** Opens the request on a chain, leaving out (within maxReplays) a stage that cannot be reached. */
  async function open (signal: AbortSignal): Promise<void> {
    while (true) {
      try {
        await begin(signal)
        return
      } catch (err) {
        if (!(err instanceof StageLostError) || signal.aborted || attempt >= maxReplays) throw beforeFirstToken(err)
        if (err.peerId !== undefined) excluded.push(err.peerId)
        await end()
        attempt++
      }
    }
  }

  /**
   * Runs a step; on a lost stage, rebuilds the chain and replays the whole history (plainly: a
   * verify lost midway comes back as its token's plain next token, no draft accepted).
   */
  async function step (ids: number[], start: number, signal: AbortSignal, drafts?: number[]): Promise<{ accepted: number, next: number }> {
    if (!live) await open(signal)
    try {
      // The prompt's first positions came from a kept prefix: only the rest runs.
      const skip = Math.max(0, Math.min(ids.length, (from?.length ?? 0) - start))
      return await run(ids.slice(skip), start + skip, signal, drafts)
    } catch (err) {
      let last = err
      while (!signal.aborted) {
        const refused = from !== undefined && prefixRefused(last)
        if (!refused && !(last instanceof StageLostError && attempt < maxReplays)) break
        if (refused) {
          init.prefix?.lost(from!.key, from!.pullFrom !== undefined)
          prefixOff = true
        } else if (last instanceof StageLostError && last.peerId !== undefined) excluded.push(last.peerId)
        await end()
        if (!refused) attempt++
        try {
          await begin(signal)
          const skip = from?.length ?? 0
          return await run(history.slice(skip), skip, signal)
        } catch (again) {
          last = again
        }
      }
      throw beforeFirstToken(last)
    }
  }

  return {
    get route () { return chain.map(h => h.peerId) },
    get hops () { return chain.map(h => ({ peerId: h.peerId, layers: [h.layers[0], h.layers[1]] as [number, number] })) },
    get replays () { return attempt },
    get reused () { return from?.length ?? 0 },
    get movedFrom () { return from?.pullFrom?.map(p => p.peerId) ?? [] },
    async connect (signal) { if (!live) await open(signal) },
    async prefill (promptIds, signal) {
      if (history.length > 0) throw new ShoalError('SHOAL_ERR_INTERNAL', 'prefill runs once per source')
      history.push(...promptIds)
      return (await step(promptIds, 0, signal)).next
    },
    async decode (tokenId, position, signal) {
      if (position !== history.length) throw new ShoalError('SHOAL_ERR_INTERNAL', `decode at position ${position}, the sequence holds ${history.length}`)
      history.push(tokenId)
      return (await step([tokenId], position, signal)).next
    },
    async verify (tokenId, position, drafts, signal) {
      if (position !== history.length) throw new ShoalError('SHOAL_ERR_INTERNAL', `verify at position ${position}, the sequence holds ${history.length}`)
      history.push(tokenId)
      const r = drafts.length === 0 ? await step([tokenId], position, signal) : await step([tokenId, ...drafts], position, signal, drafts)
      history.push(...drafts.slice(0, r.accepted))
      return r
    },
    finish,
    close: end,
  }
}
