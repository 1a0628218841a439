/**
 * Answers a started generation in OpenAI's shapes, streaming (SSE chunks) or whole. The two
 * completion routes differ only in their `ResponseShape`. After `start`, a non-streaming failure
 * is still a proper HTTP error; a streaming one becomes an error event before `[DONE]`.
 */
import type { FastifyReply } from 'fastify'
import type { FinishReason, Usage } from '../service.ts'
import { describeError, sendError } from './errors.ts'
import type { Generation, StartEvent } from './generation.ts'
import type { ParsedRequest } from './params.ts'
import { openSse } from './sse.ts'

type Choice = Record<string, unknown>

export interface ResponseShape {
  idPrefix: string
  object: string
  chunkObject: string
  /** A chunk sent before any token (chat's `{role:'assistant', content:''}`), if any. */
  openingChoice?: () => Choice
  /** `first` is true for the first chunk that carries a choice of this shape. */
  deltaChoice: (text: string, tokenIds: number[], first: boolean) => Choice
  finishChoice: (reason: FinishReason, first: boolean) => Choice
  fullChoice: (text: string, tokenIds: number[], reason: FinishReason, start: StartEvent) => Choice
}

function usageOf (u: Usage): Record<string, number> {
  return { prompt_tokens: u.promptTokens, completion_tokens: u.completionTokens, total_tokens: u.promptTokens + u.completionTokens }
}

function shoalOf (gen: Generation): Record<string, unknown> {
  return {
    receipt_id: gen.start.receiptId,
    route: gen.start.route,
    ...(gen.start.prefix === undefined ? {} : { prefix_reused_tokens: gen.start.prefix.reusedTokens }),
  }
}

export async function respond (reply: FastifyReply, gen: Generation, requestId: string, parsed: ParsedRequest, shape: ResponseShape): Promise<void> {
  const base = {
    id: `${shape.idPrefix}${requestId}`,
    created: Math.floor(Date.now() / 1000),
    model: parsed.model,
  }
  try {
    if (parsed.stream) await streamResponse(reply, gen, parsed, shape, base)
    else await wholeResponse(reply, gen, shape, base)
  } finally {
    gen.close()
  }
}

async function wholeResponse (reply: FastifyReply, gen: Generation, shape: ResponseShape, base: Record<string, unknown>): Promise<void> {
  // The receipt id is announced only with the completion it belongs to: a failure before `end`
  // (the ledger's append included) leaves no receipt behind.
  const { 'x-shoal-receipt': receipt, ...headers } = gen.headers
  reply.headers(headers)
  let text = ''
  const tokenIds: number[] = []
  try {
    for await (const ev of gen.events()) {
      if (ev.type === 'delta') {
        text += ev.text
        tokenIds.push(...ev.tokenIds)
      } else {
        if (receipt !== undefined) reply.header('x-shoal-receipt', receipt)
        await reply.send({
          ...base,
          object: shape.object,
          choices: [shape.fullChoice(text, tokenIds, ev.finishReason, gen.start)],
          usage: usageOf(ev.usage),
          shoal: shoalOf(gen),
        })
        return
      }
    }
  } catch (err) {
    if (!reply.raw.destroyed) await sendError(reply, err)
  }
}

async function streamResponse (reply: FastifyReply, gen: Generation, parsed: ParsedRequest, shape: ResponseShape, base: Record<string, unknown>): Promise<void> {
  reply.hijack()
  const sse = openSse(reply.raw, gen.headers)
  const chunk = { ...base, object: shape.chunkObject }
  // With include_usage every chunk carries `usage: null` and a last chunk carries the totals.
  const usageNull = parsed.includeUsage ? { usage: null } : {}
  let first = true
  const send = async (choice: Choice, extra: Record<string, unknown> = {}): Promise<boolean> => {
    const ok = await sse.send({ ...chunk, choices: [choice], ...usageNull, ...extra }, gen.signal)
    first = false
    return ok
  }
  try {
    if (shape.openingChoice !== undefined && !await send(shape.openingChoice())) return
    for await (const ev of gen.events()) {
      if (ev.type === 'delta') {
        if (ev.text === '' && ev.tokenIds.length === 0) continue
        if (!await send(shape.deltaChoice(ev.text, ev.tokenIds, first))) return
        continue
      }
      // The last event before [DONE] names the receipt.
      if (parsed.includeUsage) {
        if (!await send(shape.finishChoice(ev.finishReason, first))) return
        await sse.send({ ...chunk, choices: [], usage: usageOf(ev.usage), shoal: shoalOf(gen) }, gen.signal)
      } else {
        await send(shape.finishChoice(ev.finishReason, first), { shoal: shoalOf(gen) })
      }
      sse.done()
      return
    }
  } catch (err) {
    if (sse.closed) return
    const { body } = describeError(err)
    if (body.error.code === 'SHOAL_ERR_INTERNAL') reply.log.error({ err }, 'generation failed after start')
    await sse.send(body, AbortSignal.timeout(5_000))
    sse.done()
  } finally {
    // A stream that ended any other way (client gone) must not leave the socket open.
    if (!sse.closed) reply.raw.end()
  }
}
