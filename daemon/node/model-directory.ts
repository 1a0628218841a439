/**
 * Several local services behind one InferenceService: dispatch by model id, list them all.
 */
import { ModelNotFoundError } from '../errors.ts'
import type { GenerateEvent, GenerateRequest, InferenceService, ModelCard } from '../service.ts'

export function createModelDirectory (services: InferenceService[]): InferenceService {
  const find = (model: string): InferenceService | undefined => services.find(s => s.models().some(m => m.id === model))
  return {
    models (): ModelCard[] {
      return services.flatMap(s => s.models())
    },
    async * generate (request: GenerateRequest, signal: AbortSignal): AsyncIterable<GenerateEvent> {
      const service = find(request.model)
      if (service === undefined) {
        throw new ModelNotFoundError(request.model, services.flatMap(s => s.models().map(m => m.id)))
      }
      yield * service.generate(request, signal)
    },
  }
}
