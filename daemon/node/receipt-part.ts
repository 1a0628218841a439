/**
 * Executors sign their share. A node that runs a forwarded request wraps its local service with
 * `withReceiptPart`: at the end it signs a receipt part (request and response hashes — the same
 * hashes the ingress's receipt states — token counts, timing) and sends it with the `end` event;
 * the ingress embeds it. `acceptedParts` keeps only parts whose signature checks out against the
 * key in their peer id, so a faulty peer cannot make a completion fail at its last step.
 */
import type { SignedReceiptPart } from '../ledger/index.ts'
import { createReceiptPart, publicKeyFromPeerId, requestHash, responseHash, verifyReceiptPart } from '../ledger/index.ts'
import { ShoalError } from '../errors.ts'
import type { GenerateEvent, GenerateRequest, InferenceService, ModelCard } from '../service.ts'
import { findLoneSurrogate } from '../text/index.ts'

/**
 * Checked when a request is accepted, before any work: a request with no canonical form (a lone
 * surrogate, which RFC 8785 refuses — the ingress already answers those with a 400) fails here as
 * a 400, so no completion is ever produced that cannot get its receipt. Only the cheap check runs
 * now; the hash itself is taken at the end, for requests that were admitted (a prompt refused for
 * its length is never hashed).
 */
export function checkHashable (request: GenerateRequest): void {
  const at = findLoneSurrogate(request.prompt) ?? findLoneSurrogate(request.stop) ?? findLoneSurrogate(request.model)
  if (at !== undefined) throw new ShoalError('SHOAL_ERR_BAD_REQUEST', 'the request holds a lone UTF-16 surrogate and has no canonical form to hash into its receipt')
}

export interface PartSigner {
  peerId: string
  secretKey: Uint8Array
}

export function withReceiptPart (service: InferenceService, signer: PartSigner): InferenceService {
  return {
    models (): ModelCard[] { return service.models() },
    async * generate (request: GenerateRequest, signal: AbortSignal): AsyncIterable<GenerateEvent> {
      const startedAt = Date.now()
      checkHashable(request)
      let text = ''
      const tokenIds: number[] = []
      for await (const event of service.generate(request, signal)) {
        if (event.type === 'delta') {
          text += event.text
          tokenIds.push(...event.tokenIds)
          yield event
        } else if (event.type === 'end') {
          const part = createReceiptPart({
            requestId: request.requestId,
            peerId: signer.peerId,
            model: request.model,
            layers: null,
            inputHash: requestHash(request),
            outputHash: responseHash({ text, tokenIds, finishReason: event.finishReason }),
            tokens: { input: event.usage.promptTokens, output: event.usage.completionTokens },
            timing: { startedAt, durationMs: Date.now() - startedAt },
          }, signer.secretKey)
          yield { ...event, receiptParts: [...(event.receiptParts ?? []), part] }
        } else {
          yield event
        }
      }
    },
  }
}

/** The parts that are well formed, bound to this request and signed by the peer they name. */
export function acceptedParts (parts: unknown[] | undefined, requestId: string): { accepted: SignedReceiptPart[], rejected: number } {
  const accepted: SignedReceiptPart[] = []
  let rejected = 0
  for (const part of parts ?? []) {
    const body = (part as { body?: { peerId?: unknown, requestId?: unknown } } | null)?.body
    const key = typeof body?.peerId === 'string' ? publicKeyFromPeerId(body.peerId) : undefined
    if (key !== undefined && body?.requestId === requestId && verifyReceiptPart(part, key)) accepted.push(part as SignedReceiptPart)
    else rejected++
  }
  return { accepted, rejected }
}
