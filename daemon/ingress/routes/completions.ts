/** POST /v1/completions, with vLLM's `return_token_ids` extension. */
import type { FastifyInstance } from 'fastify'
import { beginGeneration, type GenerationContext } from '../generation.ts'
import { parseCompletionBody } from '../params.ts'
import { respond, type ResponseShape } from '../respond.ts'
import { completionBodySchema, type CompletionBody } from '../schemas.ts'

function completionShape (returnTokenIds: boolean, promptTokenIds: () => number[]): ResponseShape {
  const ids = (tokenIds: number[], first: boolean): Record<string, unknown> => !returnTokenIds
    ? {}
    : first ? { prompt_token_ids: promptTokenIds(), token_ids: tokenIds } : { token_ids: tokenIds }
  return {
    idPrefix: 'cmpl-',
    object: 'text_completion',
    chunkObject: 'text_completion',
    deltaChoice: (text, tokenIds, first) => ({ index: 0, text, logprobs: null, finish_reason: null, ...ids(tokenIds, first) }),
    finishChoice: (reason, first) => ({ index: 0, text: '', logprobs: null, finish_reason: reason, ...ids([], first) }),
    fullChoice: (text, tokenIds, reason) => ({ index: 0, text, logprobs: null, finish_reason: reason, ...ids(tokenIds, true) }),
  }
}

export function registerCompletionsRoute (app: FastifyInstance, ctx: GenerationContext): void {
  app.post<{ Body: CompletionBody }>('/v1/completions', {
    schema: { body: completionBodySchema },
    config: { completion: true },
  }, async (request, reply) => {
    const parsed = parseCompletionBody(request.body)
    const gen = await beginGeneration(ctx, request.id, reply, parsed)
    const shape = completionShape(parsed.returnTokenIds, () => gen.start.promptTokenIds)
    await respond(reply, gen, request.id, parsed, shape)
    return reply
  })
}
