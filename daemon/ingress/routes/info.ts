/** The read-only routes: models, receipts, mesh, health and metrics. */
import type { FastifyInstance } from 'fastify'
import type { Registry } from 'prom-client'
import type { InferenceService } from '../../service.ts'
import { RequestError } from '../errors.ts'
import type { MeshView, ReceiptLookup } from '../types.ts'

export interface InfoComponents {
  service: InferenceService
  receipts?: ReceiptLookup
  mesh?: MeshView
  registry: Registry
}

const notFound = (message: string): RequestError => new RequestError('SHOAL_ERR_NOT_FOUND', message)

export function registerInfoRoutes (app: FastifyInstance, c: InfoComponents): void {
  app.get('/v1/models', async () => ({
    object: 'list',
    data: c.service.models().map(m => {
      const card: Record<string, unknown> = { id: m.id, object: 'model', created: m.created, owned_by: m.ownedBy, context_length: m.contextLength }
      if (m.description !== undefined) card.description = m.description
      if (m.servedBy !== undefined) card.served_by = m.servedBy
      return card
    }),
  }))

  app.get<{ Params: { id: string } }>('/v1/receipts/:id', async (request) => {
    if (c.receipts === undefined) throw notFound('This node keeps no receipts')
    const receipt = await c.receipts.get(request.params.id)
    if (receipt === undefined) throw new RequestError('SHOAL_ERR_NOT_FOUND', `No receipt with id '${request.params.id}'`, 'id')
    return receipt
  })

  app.get('/v1/mesh', async () => {
    if (c.mesh === undefined) throw notFound('This node is not part of a mesh')
    return c.mesh.snapshot()
  })

  app.get('/healthz', async () => ({ status: 'ok' }))

  app.get('/metrics', async (_request, reply) => {
    const text = await c.registry.metrics()
    return reply.type(c.registry.contentType).send(text)
  })
}
