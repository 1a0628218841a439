/**
 * SimulatedPeer: a control-plane test fixture implementing InferenceService with no weights, for
 * routing and forwarding tests where it stands in for a peer's engine. Tokens are a deterministic
 * function of the prompt (`tokensFor`); each takes a fixed time (a real timer, not a busy loop).
 * Hooks let tests hold a request before `start`, stall it after N tokens, fail it, and observe
 * when its AbortSignal fires. (The ingress's fake, with a tokenizer, chat template and scripted
 * replies, is `createSimulatedService` beside it.)
 */
import { ShoalError } from '../../daemon/errors.ts'
import type { GenerateEvent, GenerateRequest, InferenceService, ModelCard } from '../../daemon/service.ts'
import { sleep, untilOrAbort } from './abortable.ts'

export interface SimulatedPeerInit {
  model?: string
  msPerToken?: number
  /** Tokens generated when the request has no maxTokens. */
  defaultTokens?: number
  contextLength?: number
  /** Thrown before start (e.g. an OVERLOADED or CONTEXT_LENGTH ShoalError). */
  failBeforeStart?: () => Error | undefined
  /** Awaited before start: simulates a queue. */
  holdBeforeStart?: () => Promise<void>
  /** After this many deltas, wait forever (until aborted). */
  stallAfter?: number
  /** After this many deltas, throw this error. */
  failAfter?: { tokens: number, error: () => Error }
}

interface Seen { request: GenerateRequest, arrived: PromiseWithResolvers<void>, aborted: PromiseWithResolvers<unknown> }

export class SimulatedPeer implements InferenceService {
  readonly model: string
  private readonly init: SimulatedPeerInit
  private readonly seen = new Map<string, Seen>()
  /** Requests that reached generate(), in order. */
  readonly calls: string[] = []

  constructor (init: SimulatedPeerInit = {}) {
    this.init = init
    this.model = init.model ?? 'sim-1'
  }

  models (): ModelCard[] {
    return [{ id: this.model, created: 1_700_000_000, ownedBy: 'shoal', contextLength: this.init.contextLength ?? 4096, description: 'simulated (tests)' }]
  }

  /** The token ids this service produces for `request`. */
  static tokensFor (request: GenerateRequest, count: number): number[] {
    const text = JSON.stringify(request.prompt)
    let h = 2166136261
    for (let i = 0; i < text.length; i++) h = Math.imul(h ^ text.charCodeAt(i), 16777619) >>> 0
    const out: number[] = []
    for (let i = 0; i < count; i++) {
      h = Math.imul(h ^ (i + 1), 2654435761) >>> 0
      out.push(h % 50_000)
    }
    return out
  }

  static textOf (id: number): string {
    return `<${id}>`
  }

  private entry (requestId: string): Seen {
    let s = this.seen.get(requestId)
    if (s === undefined) {
      s = { request: undefined as unknown as GenerateRequest, arrived: Promise.withResolvers<void>(), aborted: Promise.withResolvers<unknown>() }
      this.seen.set(requestId, s)
    }
    return s
  }

  /** Resolves when the request reaches this service. */
  async arrived (requestId: string): Promise<void> {
    await this.entry(requestId).arrived.promise
  }

  /** Resolves with the abort reason when the request's signal fires. */
  async aborted (requestId: string): Promise<unknown> {
    return await this.entry(requestId).aborted.promise
  }

  async * generate (request: GenerateRequest, signal: AbortSignal): AsyncGenerator<GenerateEvent, void, undefined> {
    const s = this.entry(request.requestId)
    s.request = request
    this.calls.push(request.requestId)
    if (signal.aborted) s.aborted.resolve(signal.reason)
    else signal.addEventListener('abort', () => s.aborted.resolve(signal.reason), { once: true })
    s.arrived.resolve()
    if (request.model !== this.model) throw new ShoalError('SHOAL_ERR_MODEL_NOT_FOUND', `no model ${request.model}`)
    const failure = this.init.failBeforeStart?.()
    if (failure !== undefined) throw failure
    if (this.init.holdBeforeStart !== undefined) await untilOrAbort(this.init.holdBeforeStart(), signal)
    const promptIds = request.prompt.kind === 'tokens' ? request.prompt.ids : [1, 2, 3]
    yield { type: 'start', promptTokenIds: promptIds, route: [], receiptId: request.requestId }
    const n = request.maxTokens ?? this.init.defaultTokens ?? 8
    const ids = SimulatedPeer.tokensFor(request, n)
    for (let i = 0; i < ids.length; i++) {
      if (this.init.stallAfter !== undefined && i >= this.init.stallAfter) await untilOrAbort(new Promise(() => {}), signal)
      if (this.init.failAfter !== undefined && i >= this.init.failAfter.tokens) throw this.init.failAfter.error()
      await sleep(this.init.msPerToken ?? 1, signal)
      const id = ids[i] as number
      yield { type: 'delta', text: SimulatedPeer.textOf(id), tokenIds: [id] }
    }
    yield { type: 'end', finishReason: 'length', usage: { promptTokens: promptIds.length, completionTokens: n } }
  }
}
