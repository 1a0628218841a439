/** Starts a real ingress on 127.0.0.1:0 in front of the simulated service, with an openai client. */
import OpenAI from 'openai'
import { createIngress, type Ingress, type IngressComponents, type IngressInit } from '../../daemon/ingress/index.ts'
import { createSimulatedService, type SimulatedScript, type SimulatedService } from '../support/simulated-service.ts'

export interface Harness {
  url: string
  client: OpenAI
  service: SimulatedService
  ingress: Ingress
  stop: () => Promise<void>
}

/** Models by name → script; 'sim' is the plain model. */
export async function startHarness (scripts: Record<string, SimulatedScript & { contextLength?: number }> = {},
  init: IngressInit = {}, extra: Partial<IngressComponents> = {}): Promise<Harness> {
  const service = createSimulatedService({
    models: [{ id: 'sim' }, ...Object.entries(scripts).map(([id, s]) => ({ id, contextLength: s.contextLength ?? 2048 }))],
    script: (request) => scripts[request.model] ?? {},
  })
  const ingress = createIngress({ logger: false, ...init }, { service, ...extra })
  const { url } = await ingress.start()
  // No retries: the tests look at each status the server answers.
  const client = new OpenAI({ baseURL: `${url}/v1`, apiKey: 'x', maxRetries: 0 })
  return { url, client, service, ingress, stop: async () => { await ingress.stop() } }
}

/** Reads an SSE body into its `data:` payloads. */
export async function readSse (res: Response): Promise<string[]> {
  const text = await res.text()
  return text.split('\n\n').filter(e => e !== '').map(e => {
    if (!e.startsWith('data: ')) throw new Error(`not an SSE data event: ${JSON.stringify(e)}`)
    return e.slice('data: '.length)
  })
}

export function expectOpenAIError (body: unknown): { message: string, type: string, param: string | null, code: string } {
  const e = (body as { error?: Record<string, unknown> }).error
  if (e === undefined || typeof e.message !== 'string' || typeof e.type !== 'string' || !('param' in e) || typeof e.code !== 'string') {
    throw new Error(`not an OpenAI error body: ${JSON.stringify(body)}`)
  }
  return e as { message: string, type: string, param: string | null, code: string }
}
