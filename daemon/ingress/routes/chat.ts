/** POST /v1/chat/completions */
import type { FastifyInstance } from 'fastify'
import { beginGeneration, type GenerationContext } from '../generation.ts'
import { parseChatBody } from '../params.ts'
import { respond, type ResponseShape } from '../respond.ts'
import { chatBodySchema, type ChatBody } from '../schemas.ts'

const chatShape: ResponseShape = {
  idPrefix: 'chatcmpl-',
  object: 'chat.completion',
  chunkObject: 'chat.completion.chunk',
  openingChoice: () => ({ index: 0, delta: { role: 'assistant', content: '' }, logprobs: null, finish_reason: null }),
  deltaChoice: (text) => ({ index: 0, delta: { content: text }, logprobs: null, finish_reason: null }),
  finishChoice: (reason) => ({ index: 0, delta: {}, logprobs: null, finish_reason: reason }),
  fullChoice: (text, _ids, reason) => ({
    index: 0,
    message: { role: 'assistant', content: text, refusal: null },
    logprobs: null,
    finish_reason: reason,
  }),
}

export function registerChatRoute (app: FastifyInstance, ctx: GenerationContext): void {
  app.post<{ Body: ChatBody }>('/v1/chat/completions', {
    schema: { body: chatBodySchema },
    config: { completion: true },
  }, async (request, reply) => {
    const parsed = parseChatBody(request.body)
    const gen = await beginGeneration(ctx, request.id, reply, parsed)
    await respond(reply, gen, request.id, parsed, chatShape)
    return reply
  })
}
