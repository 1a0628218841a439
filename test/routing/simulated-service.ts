/**
 * SimulatedService: a control-plane test fixture implementing InferenceService with no weights.
 * Tokens are a deterministic function of the prompt; each takes a fixed time (a real timer, not a
 * busy loop). Hooks let tests hold a request before `start`, stall it after N tokens, fail it, and
 * observe when its AbortSignal fires.
 */
import { ShoalError } from '../../daemon/errors.ts'
import type { GenerateEvent, GenerateRequest, InferenceService, ModelCard } from '../../daemon/service.ts'

export interface SimulatedServiceInit {
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

export class SimulatedService implements InferenceService {
  readonly model: string
  private readonly init: SimulatedServiceInit
  private readonly seen = new Map<string, Seen>()
  /** Requests that reached generate(), in order. */
  readonly calls: string[] = []

  constructor (init: SimulatedServiceInit = {}) {
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
    if (this.init.holdBeforeStart !== undefined) await abortable(this.init.holdBeforeStart(), signal)
    const promptIds = request.prompt.kind === 'tokens' ? request.prompt.ids : [1, 2, 3]
    yield { type: 'start', promptTokenIds: promptIds, route: [], receiptId: request.requestId }
    const n = request.maxTokens ?? this.init.defaultTokens ?? 8
    const ids = SimulatedService.tokensFor(request, n)
    for (let i = 0; i < ids.length; i++) {
      if (this.init.stallAfter !== undefined && i >= this.init.stallAfter) await abortable(new Promise(() => {}), signal)
      if (this.init.failAfter !== undefined && i >= this.init.failAfter.tokens) throw this.init.failAfter.error()
      await sleep(this.init.msPerToken ?? 1, signal)
      const id = ids[i] as number
      yield { type: 'delta', text: SimulatedService.textOf(id), tokenIds: [id] }
    }
    yield { type: 'end', finishReason: 'length', usage: { promptTokens: promptIds.length, completionTokens: n } }
  }
}

export async function sleep (ms: number, signal: AbortSignal): Promise<void> {
  await abortable(new Promise(resolve => setTimeout(resolve, ms)), signal)
}

async function abortable<T> (p: Promise<T>, signal: AbortSignal): Promise<T> {
  signal.throwIfAborted()
  let onAbort = (): void => {}
  try {
    return await Promise.race([p, new Promise<never>((_r, reject) => {
      onAbort = () => reject(signal.reason instanceof Error ? signal.reason : new ShoalError('SHOAL_ERR_ABORTED', 'aborted'))
      signal.addEventListener('abort', onAbort, { once: true })
    })])
  } finally {
    signal.removeEventListener('abort', onAbort)
  }
}
