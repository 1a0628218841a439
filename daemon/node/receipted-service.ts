/**
 * Every completion gets a signed receipt: this wraps the service the ingress talks to, collects
 * what was asked and answered, and appends the receipt to the ledger BEFORE the `end` event goes
 * out, so no acknowledged completion lacks its receipt. Failed or cancelled requests get none.
 * The certificates of the nodes that signed parts (as the mesh admitted them) go into the log too.
 */
import type { Ledger } from '../ledger/index.ts'
import { buildReceiptInput } from '../ledger/index.ts'
import { stepMark } from '../step-trace.ts'
import { acceptedParts, checkHashable } from './receipt-part.ts'
import type { GenerateEvent, GenerateRequest, InferenceService, ModelCard, PrefixReuse, RouteHop } from '../service.ts'

export interface ReceiptOptions {
  /** Called when parts whose signatures do not verify were left out of a receipt. */
  onRejectedParts?: (requestId: string, count: number) => void
  /** An admitted peer's certificate (the mesh's), stored with receipts that carry its part. */
  certificateOf?: (peerId: string) => unknown
}

export function withReceipts (service: InferenceService, ledger: Ledger, options: ReceiptOptions = {}): InferenceService {
  return {
    models (): ModelCard[] {
      return service.models()
    },
    async * generate (request: GenerateRequest, signal: AbortSignal): AsyncIterable<GenerateEvent> {
      const startedAt = Date.now()
      // Before any work: a request that could not be receipted is a 400, never a 500 after generating.
      checkHashable(request)
      let firstTokenAt: number | undefined
      let hops: RouteHop[] = []
      let manifestHash: string | undefined
      let prefix: PrefixReuse | undefined
      let text = ''
      const tokenIds: number[] = []
      for await (const event of service.generate(request, signal)) {
        if (event.type === 'start') {
          hops = event.hops ?? event.route.map(peerId => ({ peerId }))
          manifestHash = event.manifestHash
          prefix = event.prefix
        } else if (event.type === 'delta') {
          firstTokenAt ??= Date.now()
          text += event.text
          tokenIds.push(...event.tokenIds)
        } else {
          stepMark('r.end')
          const parts = acceptedParts(event.receiptParts, request.requestId)
          if (parts.rejected > 0) options.onRejectedParts?.(request.requestId, parts.rejected)
          const input = buildReceiptInput(request, { text, tokenIds, finishReason: event.finishReason }, {
            manifestHash: manifestHash ?? null,
            ...(event.speculation === undefined ? {} : { speculation: event.speculation }),
            ...(prefix === undefined ? {} : { prefix }),
            route: hops,
            parts: parts.accepted,
            usage: event.usage,
            timing: { startedAt, firstTokenMs: firstTokenAt === undefined ? null : firstTokenAt - startedAt, totalMs: Date.now() - startedAt },
          })
          const certificates = [...new Set(parts.accepted.map(p => p.body.peerId))]
            .map(peerId => options.certificateOf?.(peerId))
            .filter(c => c !== undefined)
          stepMark('r.built')
          await ledger.append(input, { signal, certificates })
          stepMark('r.appended')
        }
        yield event
      }
    },
  }
}
