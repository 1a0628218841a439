/**
 * One completion's life on the service side: an AbortController fed by client disconnect, the
 * deadline and shutdown; waiting for the `start` event (errors before it are plain HTTP errors);
 * then the delta/end events, with token timing metrics. Every wait races the abort signal, so a
 * service that ignores its signal still cannot hold a request past its deadline.
 */
import { performance } from 'node:perf_hooks'
import type { FastifyReply } from 'fastify'
import { ShoalError } from '../errors.ts'
import type { GenerateEvent, GenerateRequest, InferenceService } from '../service.ts'
import type { IngressMetrics } from './metrics.ts'
import type { ParsedRequest } from './params.ts'
import { clientOf } from './auth.ts'
import { raceAbort } from '../abort.ts'
import { stepMark } from '../step-trace.ts'

export type StartEvent = Extract<GenerateEvent, { type: 'start' }>
export type BodyEvent = Exclude<GenerateEvent, { type: 'start' }>

export interface GenerationContext {
  service: InferenceService
  metrics: IngressMetrics
  requestTimeoutMs: number
  /** Controllers of running generations, aborted when a drain runs out of time. */
  running: Set<AbortController>
}

export interface Generation {
  start: StartEvent
  /** x-shoal-route, x-shoal-receipt, x-request-id and, when a kept prefix was reused, x-shoal-prefix-reused. */
  headers: Record<string, string>
  signal: AbortSignal
  /** The events after `start`, ending with `end`; throws the abort reason once aborted. */
  events (): AsyncGenerator<BodyEvent>
  /** Releases timers and the service's iterator; aborts the service if the events were not read to the end. */
  close (): void
}

export async function beginGeneration (ctx: GenerationContext, requestId: string, reply: FastifyReply, parsed: ParsedRequest): Promise<Generation> {
  const began = performance.now()
  const ac = new AbortController()
  const { signal } = ac
  const timer = setTimeout(() => {
    ac.abort(new ShoalError('SHOAL_ERR_DEADLINE', `Request did not finish within ${ctx.requestTimeoutMs} ms`))
  }, ctx.requestTimeoutMs)
  // 'close' also fires after a normal end; only an unfinished response means the client left.
  const onClose = (): void => {
    if (!reply.raw.writableFinished) ac.abort(new ShoalError('SHOAL_ERR_ABORTED', 'Client disconnected'))
  }
  reply.raw.once('close', onClose)
  ctx.running.add(ac)

  const request: GenerateRequest = {
    requestId,
    model: parsed.model,
    prompt: parsed.prompt,
    maxTokens: parsed.maxTokens,
    sampling: parsed.sampling,
    stop: parsed.stop,
    deadline: Date.now() + ctx.requestTimeoutMs,
  }
  const client = clientOf(reply.request)
  if (client !== undefined) request.client = client
  let finished = false
  let iterator: AsyncIterator<GenerateEvent> | undefined
  const close = (): void => {
    clearTimeout(timer)
    reply.raw.off('close', onClose)
    ctx.running.delete(ac)
    if (!finished && !signal.aborted) ac.abort(new ShoalError('SHOAL_ERR_ABORTED', 'Response abandoned'))
    // Also after `end`: lets the service's generator run its cleanup (finally blocks).
    iterator?.return?.().catch(() => {})
  }

  let start: StartEvent
  try {
    stepMark('i.gen')
    iterator = ctx.service.generate(request, signal)[Symbol.asyncIterator]()
    const first = await nextOrAbort(iterator, signal)
    stepMark('i.start')
    if (first.done === true) throw new ShoalError('SHOAL_ERR_INTERNAL', 'Generation ended before it started')
    if (first.value.type !== 'start') throw new ShoalError('SHOAL_ERR_INTERNAL', `Expected a start event, got '${first.value.type}'`)
    start = first.value
  } catch (err) {
    const reason: unknown = signal.aborted ? signal.reason : err
    close()
    throw reason
  }

  const it = iterator
  const labels = { model: parsed.model }
  ctx.metrics.promptTokens.inc(labels, start.promptTokenIds.length)
  async function * events (): AsyncGenerator<BodyEvent> {
    let last: number | undefined
    while (true) {
      const r = await nextOrAbort(it, signal)
      if (r.done === true) throw new ShoalError('SHOAL_ERR_INTERNAL', 'Generation ended without an end event')
      const ev = r.value
      if (ev.type === 'delta') {
        const n = ev.tokenIds.length
        if (n > 0) {
          const now = performance.now()
          if (last === undefined) ctx.metrics.timeToFirstToken.observe(labels, (now - began) / 1000)
          else for (let i = 0; i < n; i++) ctx.metrics.interToken.observe(labels, (now - last) / 1000 / n)
          last = now
          ctx.metrics.tokensGenerated.inc(labels, n)
        }
        yield ev
      } else if (ev.type === 'end') {
        finished = true
        yield ev
        return
      } else {
        throw new ShoalError('SHOAL_ERR_INTERNAL', `Unexpected '${ev.type}' event after start`)
      }
    }
  }

  return {
    start,
    headers: {
      'x-shoal-route': start.route.join(','),
      'x-shoal-receipt': start.receiptId,
      'x-request-id': requestId,
      // Prompt tokens the executing node took from its KV prefix cache (not prefilled).
      ...(start.prefix === undefined ? {} : { 'x-shoal-prefix-reused': String(start.prefix.reusedTokens) }),
      ...(start.prefix?.movedFrom === undefined ? {} : { 'x-shoal-prefix-moved-from': start.prefix.movedFrom }),
    },
    signal,
    events,
    close,
  }
}

/** iterator.next() raced against the signal; once aborted, the abort reason is what is thrown. */
async function nextOrAbort<T> (it: AsyncIterator<T>, signal: AbortSignal): Promise<IteratorResult<T>> {
  return await raceAbort(it.next(), signal)
}
