-- Run once by the postgres image on an empty data directory (/docker-entrypoint-initdb.d),
-- as POSTGRES_USER: MLflow gets its own database beside Meshflow's job store (`meshflow`).
CREATE DATABASE mlflow;
